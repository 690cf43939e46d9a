//! Byte channels with per-direction credit multiplexed over one WebSocket: a sans-IO core and a thin tokio driver.
