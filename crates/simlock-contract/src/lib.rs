//! The simlock contract: frames, hello, the operation table, inputs and outputs with their bounds, pushes and the error table.
