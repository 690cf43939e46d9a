//! The /v1/agent-device edge: the front agents talk to, over a HostLink port.
