//! The dispatch pipeline and the socket and HTTP hosts shared by the worker and the gateway.
