//! The gateway domain: worker links and views, the lease index, the fleet queue and routing.
