//! Reading what the Android tools print: `adb devices`, `avdmanager list device`, `adb emu`
//! replies, `getprop` values; and the baseline key (FNV-1a over what a snapshot depends on).

use std::collections::BTreeMap;

/// One line of `adb devices`: serial and state (`device`, `offline`, `unauthorized`…).
///
/// Lines before `List of devices attached` (the daemon-start banner, when streams are merged)
/// and blank lines are skipped; the short form is tab-separated, the long form space-padded.
///
/// # Errors
/// When the header is missing: the output is not a device list.
pub fn devices(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut lines = text.lines();
    if !lines
        .by_ref()
        .any(|l| l.trim() == "List of devices attached")
    {
        return Err(format!(
            "no `List of devices attached` header in {:?}",
            text.chars().take(80).collect::<String>()
        ));
    }
    let mut out = BTreeMap::new();
    for line in lines.map(str::trim).filter(|l| !l.is_empty()) {
        let mut parts = line.split_whitespace();
        let (Some(serial), Some(state)) = (parts.next(), parts.next()) else {
            return Err(format!("a device line without a state: {line:?}"));
        };
        out.insert(serial.to_owned(), state.to_owned());
    }
    Ok(out)
}

/// A hardware profile of `avdmanager list device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// `pixel_8`.
    pub id: String,
    /// `Pixel 8`.
    pub name: String,
    /// `android-wear`…; none for phones and tablets.
    pub tag: Option<String>,
}

/// The profiles of `avdmanager list device`: blocks starting `id: N or "<id>"`, then
/// `Name:`, `OEM :`, optionally `Tag :`.
///
/// # Errors
/// When there is no `Available devices definitions:` header, or a block has no name.
pub fn profiles(text: &str) -> Result<Vec<Profile>, String> {
    if !text
        .lines()
        .any(|l| l.trim() == "Available devices definitions:")
    {
        return Err("no `Available devices definitions:` header".into());
    }
    let mut out: Vec<Profile> = Vec::new();
    let mut current: Option<Profile> = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("id:") {
            if let Some(p) = current.take() {
                out.push(p);
            }
            let id = rest
                .split('"')
                .nth(1)
                .ok_or_else(|| format!("a profile line without a quoted id: {line:?}"))?;
            current = Some(Profile {
                id: id.to_owned(),
                name: String::new(),
                tag: None,
            });
        } else if let Some(p) = current.as_mut() {
            if let Some(name) = line.strip_prefix("Name:") {
                p.name = name.trim().to_owned();
            } else if let Some(tag) = line.strip_prefix("Tag :") {
                p.tag = Some(tag.trim().to_owned());
            }
        }
    }
    out.extend(current);
    if let Some(p) = out.iter().find(|p| p.name.is_empty()) {
        return Err(format!("profile {} has no name", p.id));
    }
    Ok(out)
}

/// The reply of `adb emu …`: its lines without CRLF, and whether it ended `OK` (adb's exit
/// status means nothing: only the text counts).
pub fn emu_reply(text: &str) -> (Vec<String>, bool) {
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.trim_end_matches('\r').to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    let ok = lines
        .last()
        .is_some_and(|l| l == "OK" || l.starts_with("OK:"))
        && !lines.iter().any(|l| l.starts_with("KO"));
    (lines, ok)
}

/// A `getprop` value, without the `\r\n` older images end it with.
pub fn prop(text: &str) -> &str {
    text.trim()
}

/// FNV-1a, 32 bits.
pub fn fnv1a(parts: &[&str]) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for part in parts {
        for byte in part.bytes().chain(std::iter::once(0)) {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
    }
    format!("{hash:08x}")
}

/// The lines of an AVD's `config.ini` a baseline snapshot depends on, sorted.
pub fn baseline_lines(config_ini: &str) -> Vec<String> {
    let mut lines: Vec<String> = config_ini
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.starts_with("image.sysdir.1")
                || l.starts_with("hw.")
                || l.starts_with("disk.dataPartition.")
        })
        .map(String::from)
        .collect();
    lines.sort();
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_skip_the_banner_and_read_both_forms() {
        let merged = "* daemon not running; starting now at tcp:5038\n* daemon started successfully\nList of devices attached\nemulator-5586\tdevice\nemulator-5588\toffline\n\n";
        let d = devices(merged).unwrap();
        assert_eq!(d["emulator-5586"], "device");
        assert_eq!(d["emulator-5588"], "offline");
        let long = "List of devices attached\nemulator-5586          device product:sdk_gphone64_arm64 model:sdk_gphone64_arm64 device:emu64a transport_id:1\n\n";
        assert_eq!(devices(long).unwrap()["emulator-5586"], "device");
        assert!(devices("adb: garbage\n").is_err());
        assert!(devices("List of devices attached\nemulator-5586\n").is_err());
    }

    #[test]
    fn profiles_read_ids_names_and_tags() {
        let text = "Available devices definitions:\nid: 0 or \"automotive_1024p_landscape\"\n    Name: Automotive (1024p landscape)\n    OEM : Google\n    Tag : android-automotive-playstore\n---------\nid: 39 or \"pixel_7\"\n    Name: Pixel 7\n    OEM : Google\n";
        let p = profiles(text).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            p[1],
            Profile {
                id: "pixel_7".into(),
                name: "Pixel 7".into(),
                tag: None
            }
        );
        assert_eq!(p[0].tag.as_deref(), Some("android-automotive-playstore"));
        assert!(profiles("Error: something\nnull\n").is_err());
        assert!(profiles("Available devices definitions:\nid: 3 no quotes\n").is_err());
    }

    #[test]
    fn emu_replies_are_judged_by_their_text() {
        assert!(emu_reply("OK: killing emulator, bye bye\r\nOK\r\n").1);
        assert!(emu_reply("/x/a.avd\r\nOK\r\n").1);
        assert!(!emu_reply("KO: snapshot 'x' does not exist\r\n").1);
        assert!(!emu_reply("").1);
        assert_eq!(emu_reply("/x/a.avd\r\nOK\r\n").0[0], "/x/a.avd");
    }

    #[test]
    fn the_baseline_key_changes_with_what_the_snapshot_depends_on() {
        let a = fnv1a(&["img@7", "35.1", "hw.ramSize=2048"]);
        assert_eq!(a, fnv1a(&["img@7", "35.1", "hw.ramSize=2048"]));
        assert_ne!(a, fnv1a(&["img@7", "35.2", "hw.ramSize=2048"]));
        assert_eq!(
            baseline_lines(
                "b=1\nhw.ramSize=2048\nimage.sysdir.1=x/\nAvdId=a\nhw.lcd.density=420\n"
            ),
            ["hw.lcd.density=420", "hw.ramSize=2048", "image.sysdir.1=x/"]
        );
    }
}
