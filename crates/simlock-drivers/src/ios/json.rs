//! What `simctl … -j` prints, read into types; and the catalog built from it.
//!
//! Only what the driver uses is read; every other key is ignored, optional keys are optional
//! (`lastBootedAt`, `buildversion`, `supportedDeviceTypes`, …), and output that does not parse is
//! a typed error naming what was expected.

use std::collections::BTreeMap;

use serde::Deserialize;
use simlock_contract::model::{Platform, PlatformCatalog};

/// Any `maxRuntimeVersion` at or above this is "no upper bound" (Xcode 26 prints 4294967295,
/// earlier ones 16777215).
const UNBOUNDED: u64 = 0x00FF_FFFF;

/// `list -j devicetypes runtimes`.
#[derive(Debug, Clone, Deserialize)]
pub struct Listing {
    /// Device types.
    pub devicetypes: Vec<DeviceType>,
    /// Runtimes.
    pub runtimes: Vec<Runtime>,
}

/// One device type.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceType {
    /// `com.apple.CoreSimulator.SimDeviceType.iPhone-16`.
    pub identifier: String,
    /// `iPhone 16`.
    pub name: String,
    /// `iPhone`, `iPad`…
    #[serde(default)]
    pub product_family: Option<String>,
    /// Packed `major<<16 | minor<<8 | patch`.
    #[serde(default)]
    pub min_runtime_version: Option<u64>,
    /// Packed; at or above 0xFFFFFF: unbounded.
    #[serde(default)]
    pub max_runtime_version: Option<u64>,
}

/// One runtime.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Runtime {
    /// `com.apple.CoreSimulator.SimRuntime.iOS-18-2` (never parsed for a version).
    pub identifier: String,
    /// `iOS 18.2`.
    pub name: String,
    /// `18.2`.
    pub version: String,
    /// Whether it runs.
    #[serde(default = "yes")]
    pub is_available: bool,
    /// `iOS`, `watchOS`…
    #[serde(default)]
    pub platform: Option<String>,
    /// The device types it pairs with; a runtime without the list pairs with none.
    #[serde(default)]
    pub supported_device_types: Option<Vec<Supported>>,
}

const fn yes() -> bool {
    true
}

/// An entry of `supportedDeviceTypes`.
#[derive(Debug, Clone, Deserialize)]
pub struct Supported {
    /// The device type's identifier.
    pub identifier: String,
}

/// `list -j devices`.
#[derive(Debug, Clone, Deserialize)]
pub struct Devices {
    /// By runtime identifier.
    pub devices: BTreeMap<String, Vec<Device>>,
}

/// One simulator.
#[derive(Debug, Clone, Deserialize)]
pub struct Device {
    /// Its UDID.
    pub udid: String,
    /// `Shutdown`, `Booted`, `Booting`, `Shutting Down`, `Creating`.
    pub state: String,
    /// Its name.
    #[serde(default)]
    pub name: String,
}

impl Devices {
    /// Every simulator of the set.
    pub fn all(&self) -> impl Iterator<Item = &Device> {
        self.devices.values().flatten()
    }

    /// The simulator `udid`.
    pub fn get(&self, udid: &str) -> Option<&Device> {
        self.all().find(|d| d.udid == udid)
    }
}

/// `major.minor[.patch]` packed as simctl packs it.
pub fn pack(version: &str) -> Option<u64> {
    let mut parts = version.split('.');
    let mut packed = 0u64;
    for shift in [16u32, 8, 0] {
        let part = match parts.next() {
            Some(p) => p.parse::<u64>().ok().filter(|v| *v <= 255)?,
            None => 0,
        };
        packed |= part << shift;
    }
    Some(packed)
}

fn is_ios(r: &Runtime) -> bool {
    r.platform.as_deref() == Some("iOS") || r.name.to_ascii_lowercase().starts_with("ios ")
}

/// What the driver can create: models (device types) and the runtimes each pairs with, by
/// their catalog names, and the identifiers `create` takes.
#[derive(Debug, Clone, Default)]
pub struct IosCatalog {
    /// Device types by catalog name, in listing order.
    pub types: Vec<(String, String)>,
    /// Runtime identifiers by version, newest first.
    pub runtimes: Vec<(String, String)>,
    /// Which versions each model runs, newest first.
    pub pairs: BTreeMap<String, Vec<String>>,
}

impl IosCatalog {
    /// Builds the catalog: available iOS runtimes, iPhone and iPad types, paired when the
    /// runtime lists the type and its version is inside the type's range.
    pub fn from_listing(listing: &Listing) -> Self {
        let mut runtimes: Vec<(&Runtime, u64)> = listing
            .runtimes
            .iter()
            .filter(|r| r.is_available && is_ios(r))
            .filter_map(|r| pack(&r.version).map(|v| (r, v)))
            .collect();
        runtimes.sort_by_key(|r| std::cmp::Reverse(r.1));
        let mut catalog = Self {
            runtimes: runtimes
                .iter()
                .map(|(r, _)| (r.version.clone(), r.identifier.clone()))
                .collect(),
            ..Self::default()
        };
        for t in &listing.devicetypes {
            let family = t.product_family.as_deref().unwrap_or_default();
            if family != "iPhone" && family != "iPad" {
                continue;
            }
            let min = t.min_runtime_version.unwrap_or(0);
            let max = t.max_runtime_version.unwrap_or(u64::MAX);
            let versions: Vec<String> = runtimes
                .iter()
                .filter(|(r, v)| {
                    r.supported_device_types
                        .as_ref()
                        .is_some_and(|s| s.iter().any(|s| s.identifier == t.identifier))
                        && *v >= min
                        && (max >= UNBOUNDED || *v <= max)
                })
                .map(|(r, _)| r.version.clone())
                .collect();
            if versions.is_empty() || catalog.pairs.contains_key(&t.name) {
                continue;
            }
            catalog.types.push((t.name.clone(), t.identifier.clone()));
            catalog.pairs.insert(t.name.clone(), versions);
        }
        // Only runtimes some model runs are offered.
        catalog
            .runtimes
            .retain(|(v, _)| catalog.pairs.values().any(|vs| vs.contains(v)));
        catalog
    }

    /// The device type identifier of model `name`.
    pub fn type_id(&self, name: &str) -> Option<&str> {
        self.types
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, id)| id.as_str())
    }

    /// The runtime identifier of version `version`.
    pub fn runtime_id(&self, version: &str) -> Option<&str> {
        self.runtimes
            .iter()
            .find(|(v, _)| v == version)
            .map(|(_, id)| id.as_str())
    }

    /// As the worker's catalog: aliases are the identifier's last part and the name without
    /// spaces, lower-case (`iPhone-16`, `iphone16`).
    pub fn platform_catalog(&self) -> PlatformCatalog {
        let model_aliases = self
            .types
            .iter()
            .map(|(name, id)| {
                let short = id.rsplit('.').next().unwrap_or(id).to_owned();
                let squashed: String = name
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .collect::<String>()
                    .to_lowercase();
                let mut aliases = vec![short];
                if !aliases.iter().any(|a| a.eq_ignore_ascii_case(&squashed))
                    && !squashed.eq_ignore_ascii_case(name)
                {
                    aliases.push(squashed);
                }
                (name.clone(), aliases)
            })
            .collect();
        PlatformCatalog {
            platform: Platform::Ios,
            models: self.types.iter().map(|(n, _)| n.clone()).collect(),
            runtimes: self.runtimes.iter().map(|(v, _)| v.clone()).collect(),
            default_runtime: self.runtimes.first().map(|(v, _)| v.clone()),
            model_runtimes: self.pairs.clone(),
            model_aliases,
            model_workers: None,
            runtime_workers: None,
            unavailable: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(max: u64, with_supported: bool) -> Listing {
        let supported = |ids: &[&str]| {
            with_supported.then(|| {
                ids.iter()
                    .map(|i| Supported {
                        identifier: (*i).to_owned(),
                    })
                    .collect()
            })
        };
        Listing {
            devicetypes: vec![
                DeviceType {
                    identifier: "com.apple.CoreSimulator.SimDeviceType.iPhone-16".into(),
                    name: "iPhone 16".into(),
                    product_family: Some("iPhone".into()),
                    min_runtime_version: Some(pack("18.0").unwrap()),
                    max_runtime_version: Some(max),
                },
                DeviceType {
                    identifier: "com.apple.CoreSimulator.SimDeviceType.iPhone-XR".into(),
                    name: "iPhone Xʀ".into(),
                    product_family: Some("iPhone".into()),
                    min_runtime_version: Some(pack("12.0").unwrap()),
                    max_runtime_version: Some(pack("17.5").unwrap()),
                },
                DeviceType {
                    identifier: "com.apple.CoreSimulator.SimDeviceType.Apple-Watch".into(),
                    name: "Apple Watch".into(),
                    product_family: Some("Apple Watch".into()),
                    min_runtime_version: None,
                    max_runtime_version: None,
                },
            ],
            runtimes: vec![
                Runtime {
                    identifier: "com.apple.CoreSimulator.SimRuntime.iOS-17-5".into(),
                    name: "iOS 17.5".into(),
                    version: "17.5".into(),
                    is_available: true,
                    platform: Some("iOS".into()),
                    supported_device_types: supported(&[
                        "com.apple.CoreSimulator.SimDeviceType.iPhone-16",
                        "com.apple.CoreSimulator.SimDeviceType.iPhone-XR",
                    ]),
                },
                Runtime {
                    identifier: "com.apple.CoreSimulator.SimRuntime.iOS-18-2".into(),
                    name: "iOS 18.2".into(),
                    version: "18.2".into(),
                    is_available: true,
                    platform: Some("iOS".into()),
                    supported_device_types: supported(&[
                        "com.apple.CoreSimulator.SimDeviceType.iPhone-16",
                        "com.apple.CoreSimulator.SimDeviceType.iPhone-XR",
                    ]),
                },
                Runtime {
                    identifier: "com.apple.CoreSimulator.SimRuntime.watchOS-11-0".into(),
                    name: "watchOS 11.0".into(),
                    version: "11.0".into(),
                    is_available: true,
                    platform: Some("watchOS".into()),
                    supported_device_types: supported(&[
                        "com.apple.CoreSimulator.SimDeviceType.Apple-Watch",
                    ]),
                },
            ],
        }
    }

    #[test]
    fn pairs_follow_the_supported_list_and_the_version_range() {
        for unbounded in [16_777_215, 4_294_967_295] {
            let c = IosCatalog::from_listing(&listing(unbounded, true));
            assert_eq!(c.pairs["iPhone 16"], ["18.2"], "min 18.0 leaves out 17.5");
            assert_eq!(c.pairs["iPhone Xʀ"], ["17.5"], "max 17.5 leaves out 18.2");
            assert!(
                !c.pairs.contains_key("Apple Watch"),
                "not a phone or tablet"
            );
            let p = c.platform_catalog();
            assert_eq!(p.runtimes, ["18.2", "17.5"], "newest first");
            assert_eq!(p.default_runtime.as_deref(), Some("18.2"));
            assert_eq!(p.resolve_model("iphone-16"), Some("iPhone 16"));
            assert_eq!(p.resolve_model("iphone16"), Some("iPhone 16"));
            assert_eq!(
                c.runtime_id("17.5"),
                Some("com.apple.CoreSimulator.SimRuntime.iOS-17-5")
            );
        }
        let c = IosCatalog::from_listing(&listing(4_294_967_295, false));
        assert!(c.types.is_empty(), "no supportedDeviceTypes: nothing pairs");
    }

    #[test]
    fn versions_pack_as_simctl_packs_them() {
        assert_eq!(pack("13.0"), Some(851_968));
        assert_eq!(pack("26.0.0"), Some(1_703_936));
        assert_eq!(pack("18.x"), None);
        assert_eq!(pack("300.1"), None);
    }
}
