//! The gateway half of the relay: GatewayRelay.
