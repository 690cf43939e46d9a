//! A typed async client for simlock daemons over the unix socket, an uplink-style WebSocket or HTTP.
