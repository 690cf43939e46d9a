//! Stateful scripted fakes of the device tools simlock's real drivers run: `xcrun simctl`,
//! `avdmanager`, `emulator` and `adb` (one binary each, in `src/bin`), for tests on a machine
//! with no Xcode and no Android SDK.
//!
//! A *fake machine* is a directory: the tools (symlinks to the fake binaries, laid out as an
//! Xcode-less `xcrun` and an SDK tree), the machine's profile (which runtimes, device types,
//! hardware profiles and system images it has), the knobs a test turns (boot time, faults) and
//! the state every fake process reads and writes under one lock, so separate processes agree:
//! simulators per device set, running emulators, adb servers and their transports, a call log,
//! the processes alive and the virtual time each piece of device work cost.
//!
//! A fake finds its machine from `SIMLOCK_FAKE_MACHINE`, else from the path it was run by (the
//! symlink in the machine), else from `PATH`. The argv grammar, output formats and exit codes
//! follow `shared/reference/drivers.md`; an argv the real tool would refuse is refused (exit
//! non-zero, a message on stderr), never silently accepted.
//!
//! Time: every step of a boot is one virtual second and takes `Knobs::step_ms` of wall time, so
//! a cold emulator boot of 60 virtual seconds takes a fraction of a second; the virtual cost of
//! each piece of work is logged for tests to compare ([`FakeMachine::virtual_costs`]).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "test support: a fake tool prints what the real one prints, takes the wall time a \
              boot step takes, and a broken fake machine is a failed test"
)]

pub mod adbwire;
pub mod machine;
pub mod simjson;
pub mod tool;

pub use machine::{
    AdbServerRecord, Call, EmulatorRecord, FakeMachine, Fault, FaultKind, Knobs, ProcRecord,
    Profile, SimDevice, SimState, Tools, VirtualCost,
};
