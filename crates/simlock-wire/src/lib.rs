//! NDJSON framing, the server Session and the WireClient that speak the simlock contract.
