//! The worker half of the relay: relay targets and relay.request.
