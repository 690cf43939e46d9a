//! The worker domain: devices and drivers, leases, the queue, capacity, events, tokens and the store.
