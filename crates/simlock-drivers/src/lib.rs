//! The real device drivers behind [`simlock_core::Driver`], and the choice per platform.
//!
//! - [`ios`]: iOS simulators over `xcrun simctl`, in a device set simlock owns.
//! - [`android`]: Android emulators over `avdmanager`, `emulator` and `adb`, with their own AVD
//!   home and simlock's own adb server.
//! - [`mod@select`]: which driver serves each platform (config, or auto-detection), logged once.
//! - [`config`]: the `drivers.*` configuration section.
//! - [`process`]: running tools, and the ledger that finds every process again after a crash.
//!
//! Facts about the tools (argv, formats, exit codes, timings) come from
//! `shared/reference/drivers.md`; the scripted fakes in `simlock-fake-tools` reproduce them.
#![warn(missing_docs)]

pub mod android;
pub mod config;
pub mod error;
pub mod ios;
mod locks;
pub mod process;
pub mod select;

pub use config::{
    AndroidDriverChoice, AndroidDriverConfig, DriversConfig, IosDriverChoice, IosDriverConfig,
};
pub use error::ToolError;
pub use select::{Unavailable, select};
