//! Resolving the `user` of an exec request: `name`, `uid` or `uid:gid`.

/// Errors of user resolution.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    /// A name that `/etc/passwd` does not have.
    #[error("user {0:?} not found in /etc/passwd")]
    UnknownName(String),
    /// A `uid:gid` whose parts are not numbers.
    #[error("bad user {0:?}: expected a name, uid or uid:gid")]
    Malformed(String),
}

/// A resolved user: numeric ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// One parsed `/etc/passwd` line: `name:password:uid:gid:gecos:home:shell`.
struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

fn entries(passwd: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    passwd.lines().filter_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let _password = fields.next()?;
        let uid = fields.next()?.parse().ok()?;
        let gid = fields.next()?.parse().ok()?;
        let home = fields.nth(1).unwrap_or_default();
        Some(PasswdEntry {
            name,
            uid,
            gid,
            home,
        })
    })
}

/// Resolves `spec` against the contents of `/etc/passwd`:
/// - `uid:gid` → exactly those ids;
/// - `uid` → that uid, with the primary gid of its passwd entry if any, else gid = uid;
/// - `name` → the uid and gid of its passwd entry.
pub fn resolve(spec: &str, passwd: &str) -> Result<Ids, UserError> {
    let malformed = || UserError::Malformed(spec.to_owned());
    if let Some((uid, gid)) = spec.split_once(':') {
        let uid = uid.parse().map_err(|_| malformed())?;
        let gid = gid.parse().map_err(|_| malformed())?;
        return Ok(Ids { uid, gid });
    }
    if spec.is_empty() {
        return Err(malformed());
    }
    if let Ok(uid) = spec.parse::<u32>() {
        let gid = entries(passwd)
            .find(|e| e.uid == uid)
            .map_or(uid, |e| e.gid);
        return Ok(Ids { uid, gid });
    }
    entries(passwd)
        .find(|e| e.name == spec)
        .map(|e| Ids {
            uid: e.uid,
            gid: e.gid,
        })
        .ok_or_else(|| UserError::UnknownName(spec.to_owned()))
}

/// The home directory of `uid` for the command's `HOME`: the home field of the first
/// `/etc/passwd` entry (contents `passwd`) with that uid, or `/` when there is none or it is
/// empty (as login(1) falls back to `/`).
pub fn home_of(uid: u32, passwd: &str) -> &str {
    entries(passwd)
        .find(|e| e.uid == uid)
        .map(|e| e.home)
        .filter(|home| !home.is_empty())
        .unwrap_or("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                          broken line\n\
                          alice:x:1000:100:Alice:/home/alice:/bin/sh\n";

    #[test]
    fn name_resolves_to_its_uid_and_primary_gid() {
        // Arrange / Act
        let ids = resolve("alice", PASSWD);

        // Assert
        assert_eq!(
            ids,
            Ok(Ids {
                uid: 1000,
                gid: 100
            })
        );
    }

    #[test]
    fn numeric_uid_takes_its_passwd_gid_or_itself() {
        // Arrange / Act
        let known = resolve("1000", PASSWD);
        let unknown = resolve("4242", PASSWD);

        // Assert
        assert_eq!(
            known,
            Ok(Ids {
                uid: 1000,
                gid: 100
            })
        );
        assert_eq!(
            unknown,
            Ok(Ids {
                uid: 4242,
                gid: 4242
            })
        );
    }

    #[test]
    fn home_comes_from_the_uids_passwd_entry_or_is_the_root_directory() {
        // Arrange
        let passwd = format!(
            "{PASSWD}nobody:x:65534:65534:nobody:/nonexistent:/bin/false\nhomeless:x:7:7::"
        );

        // Act / Assert
        assert_eq!(home_of(1000, &passwd), "/home/alice");
        assert_eq!(home_of(65534, &passwd), "/nonexistent");
        assert_eq!(home_of(7, &passwd), "/");
        assert_eq!(home_of(4242, &passwd), "/");
    }

    #[test]
    fn uid_colon_gid_is_taken_literally() {
        // Arrange / Act
        let ids = resolve("7:8", "");

        // Assert
        assert_eq!(ids, Ok(Ids { uid: 7, gid: 8 }));
    }

    #[test]
    fn unknown_names_and_malformed_specs_are_errors() {
        // Arrange / Act
        let unknown = resolve("mallory", PASSWD);
        let malformed = resolve("1:x", PASSWD);
        let empty = resolve("", PASSWD);

        // Assert
        assert_eq!(unknown, Err(UserError::UnknownName("mallory".into())));
        assert_eq!(malformed, Err(UserError::Malformed("1:x".into())));
        assert_eq!(empty, Err(UserError::Malformed(String::new())));
    }
}
