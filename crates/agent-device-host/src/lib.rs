//! Owns and proxies a worker's agent-device daemon; the relay target agent-device.
