//! What the worker's drivers can make, and how a request names one exact device spec.
//!
//! A request names a platform and, optionally, a model (name or alias, any case) and an OS
//! version. It resolves once, before admission, to one [`DeviceSpec`]: the model defaults to
//! the platform's first model and the OS version to the catalog's default runtime when the
//! model runs it, else the model's first runtime. Devices are matched on that exact spec.

use std::collections::BTreeMap;

use crate::config::VirtualModel;
use simlock_contract::model::{DeviceSpec, Platform, PlatformCatalog};

use crate::error::CoreError;

/// Builds one platform's catalog from configured models (in their order). `None` when no
/// model is of that platform.
pub fn platform_catalog(platform: Platform, models: &[VirtualModel]) -> Option<PlatformCatalog> {
    let mine: Vec<&VirtualModel> = models.iter().filter(|m| m.platform == platform).collect();
    if mine.is_empty() {
        return None;
    }
    let mut runtimes: Vec<String> = Vec::new();
    let mut model_runtimes = BTreeMap::new();
    let mut model_aliases = BTreeMap::new();
    for model in &mine {
        for runtime in &model.runtimes {
            if !runtimes.contains(runtime) {
                runtimes.push(runtime.clone());
            }
        }
        model_runtimes.insert(model.name.clone(), model.runtimes.clone());
        model_aliases.insert(model.name.clone(), model.aliases.clone());
    }
    let default_runtime = mine.first().and_then(|m| m.runtimes.first()).cloned();
    Some(PlatformCatalog {
        platform,
        models: mine.iter().map(|m| m.name.clone()).collect(),
        runtimes,
        default_runtime,
        model_runtimes,
        model_aliases,
        model_workers: None,
        runtime_workers: None,
        unavailable: None,
    })
}

/// The catalogs of every platform the worker serves.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    platforms: BTreeMap<Platform, PlatformCatalog>,
}

impl Catalog {
    /// A catalog from per-platform entries.
    pub fn new(entries: impl IntoIterator<Item = PlatformCatalog>) -> Self {
        Self {
            platforms: entries.into_iter().map(|c| (c.platform, c)).collect(),
        }
    }

    /// Every platform's catalog, or only `platform`'s.
    pub fn list(&self, platform: Option<Platform>) -> Vec<PlatformCatalog> {
        self.platforms
            .values()
            .filter(|c| platform.is_none_or(|p| p == c.platform))
            .cloned()
            .collect()
    }

    /// Resolves a request to the exact spec a device must have.
    ///
    /// # Errors
    /// `NoDriver`, `UnknownModel` or `RuntimeMissing`.
    pub fn resolve(
        &self,
        platform: Platform,
        model: Option<&str>,
        os_version: Option<&str>,
    ) -> Result<DeviceSpec, CoreError> {
        let catalog = self
            .platforms
            .get(&platform)
            .ok_or(CoreError::NoDriver(platform))?;
        if let Some(reason) = &catalog.unavailable {
            return Err(CoreError::PlatformUnavailable {
                platform,
                reason: reason.clone(),
            });
        }
        let name = match (model, os_version) {
            (Some(asked), _) => catalog
                .resolve_model(asked)
                .ok_or_else(|| CoreError::UnknownModel {
                    platform,
                    model: asked.to_owned(),
                    known: catalog.models.clone(),
                })?
                .to_owned(),
            // No model: the first model that runs the asked OS version.
            (None, Some(os)) => catalog
                .models
                .iter()
                .find(|m| runs(catalog, m, os))
                .cloned()
                .ok_or_else(|| CoreError::RuntimeMissing {
                    platform,
                    os_version: os.to_owned(),
                    model: None,
                })?,
            (None, None) => catalog
                .models
                .first()
                .cloned()
                .ok_or(CoreError::NoDriver(platform))?,
        };
        let runtimes = catalog
            .model_runtimes
            .get(&name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let os = match os_version {
            Some(os) if runs(catalog, &name, os) => os.to_owned(),
            Some(os) => {
                return Err(CoreError::RuntimeMissing {
                    platform,
                    os_version: os.to_owned(),
                    model: Some(name),
                });
            }
            None => catalog
                .default_runtime
                .as_ref()
                .filter(|d| runtimes.contains(d))
                .or_else(|| runtimes.first())
                .cloned()
                .ok_or_else(|| CoreError::RuntimeMissing {
                    platform,
                    os_version: "default".into(),
                    model: Some(name.clone()),
                })?,
        };
        Ok(DeviceSpec {
            platform,
            model: name,
            os_version: os,
        })
    }
}

fn runs(catalog: &PlatformCatalog, model: &str, os: &str) -> bool {
    catalog
        .model_runtimes
        .get(model)
        .is_some_and(|r| r.iter().any(|v| v == os))
}

#[cfg(test)]
mod tests {
    use crate::config::VirtualConfig;

    use super::*;

    fn catalog() -> Catalog {
        let models = VirtualConfig::default().models;
        Catalog::new(
            Platform::ALL
                .into_iter()
                .filter_map(|p| platform_catalog(p, &models)),
        )
    }

    #[test]
    fn the_default_catalog_has_three_ios_and_two_android_models() {
        let c = catalog();
        let ios = &c.list(Some(Platform::Ios))[0];
        assert_eq!(ios.models.len(), 3);
        assert_eq!(ios.runtimes, ["18.2", "17.5"]);
        assert_eq!(ios.default_runtime.as_deref(), Some("18.2"));
        let android = &c.list(Some(Platform::Android))[0];
        assert_eq!(android.models.len(), 2);
        assert_eq!(android.runtimes.len(), 2);
        assert_eq!(c.list(None).len(), 2);
    }

    #[test]
    fn models_resolve_by_name_or_alias_in_any_case() {
        let c = catalog();
        let spec = c.resolve(Platform::Ios, Some("IPHONE"), None).unwrap();
        assert_eq!(
            (spec.model.as_str(), spec.os_version.as_str()),
            ("iPhone 16", "18.2")
        );
        let spec = c
            .resolve(Platform::Ios, Some("ipad"), Some("17.5"))
            .unwrap();
        assert_eq!(spec.model, "iPad Air 11-inch (M2)");
        let spec = c.resolve(Platform::Android, None, None).unwrap();
        assert_eq!(
            (spec.model.as_str(), spec.os_version.as_str()),
            ("Pixel 8", "34")
        );
        let spec = c.resolve(Platform::Android, Some("pixel9"), None).unwrap();
        assert_eq!(spec.os_version, "35");
        let spec = c.resolve(Platform::Android, None, Some("35")).unwrap();
        assert_eq!(spec.model, "Pixel 8");
    }

    #[test]
    fn unknown_names_fail_with_their_codes() {
        let c = catalog();
        assert!(matches!(
            c.resolve(Platform::Ios, Some("Nokia"), None),
            Err(CoreError::UnknownModel { .. })
        ));
        assert!(matches!(
            c.resolve(Platform::Ios, Some("iPhone 16 Pro"), Some("17.5")),
            Err(CoreError::RuntimeMissing { .. })
        ));
        assert!(matches!(
            c.resolve(Platform::Android, None, Some("99")),
            Err(CoreError::RuntimeMissing { .. })
        ));
        let only_ios = Catalog::new(platform_catalog(
            Platform::Ios,
            &VirtualConfig::default().models,
        ));
        assert!(matches!(
            only_ios.resolve(Platform::Android, None, None),
            Err(CoreError::NoDriver(Platform::Android))
        ));
    }
}
