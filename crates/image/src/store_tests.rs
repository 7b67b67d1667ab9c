//! Store tests with a fake builder: no mmdebstrap, no root, no network.

use super::*;
use crate::ext4::{EXT4_MAGIC, MAGIC_OFFSET};

/// Writes a small file with an ext4 superblock magic and `fill` bytes, or fails midway.
struct FakeBuilder {
    fill: u8,
    fail: bool,
}

impl FakeBuilder {
    fn image_bytes(&self) -> Vec<u8> {
        // One 4 KiB block: superblock at 1024 with s_blocks_count_lo = 1, s_log_block_size = 2.
        let mut bytes = vec![self.fill; 4096];
        bytes[1024..2048].fill(0);
        bytes[1024 + 0x4] = 1;
        bytes[1024 + 0x18] = 2;
        bytes[MAGIC_OFFSET as usize..MAGIC_OFFSET as usize + 2]
            .copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        bytes
    }
}

impl RootfsBuilder for FakeBuilder {
    fn build(
        &self,
        _spec: &BuildSpec,
        work_dir: &Path,
        image: &Path,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), BuildError> {
        fs::write(work_dir.join("scratch"), b"tmp").unwrap();
        fs::write(image, self.image_bytes()).unwrap();
        progress(Progress::new(Phase::Bootstrap, "fake", Some(0.5)));
        if self.fail {
            return Err(BuildError::NeedsRoot);
        }
        Ok(())
    }
}

fn ok(fill: u8) -> FakeBuilder {
    FakeBuilder { fill, fail: false }
}

fn store() -> (tempfile::TempDir, ImageStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = ImageStore::new(dir.path()).with_cache_dir(dir.path().join("cache"));
    (dir, store)
}

fn spec(name: &str) -> BuildSpec {
    BuildSpec::new(name, "/nonexistent/agent")
}

fn build(store: &ImageStore, builder: &FakeBuilder, name: &str) -> Result<Manifest, StoreError> {
    store.build_with(builder, &spec(name), &mut |_| {})
}

/// Names in the images directory, hidden ones included.
fn entries(store: &ImageStore) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(store.images_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn built_image_is_listed_and_its_manifest_describes_the_file() {
    // Arrange
    let (_dir, store) = store();
    let builder = ok(1);

    // Act
    let manifest = build(&store, &builder, "debian").unwrap();
    let image = store.get("debian").unwrap();

    // Assert
    assert_eq!(store.list().unwrap(), vec![manifest.clone()]);
    assert_eq!(image.rootfs, store.images_dir().join("debian/rootfs.ext4"));
    assert_eq!(manifest.size_bytes, 4096);
    assert_eq!(manifest.sha256, sha256_file(&image.rootfs).unwrap());
    assert_eq!(manifest.suite, "bookworm");
    assert!(manifest.created.ends_with('Z') && manifest.created.len() == 20);
    assert_eq!(entries(&store), ["debian"], "no staging or scratch left");
    assert!(store.verify("debian").is_ok());
}

#[test]
fn progress_ends_with_done_at_one() {
    // Arrange
    let (_dir, store) = store();
    let mut reports = Vec::new();

    // Act
    store
        .build_with(&ok(1), &spec("debian"), &mut |p| reports.push(p))
        .unwrap();

    // Assert
    let phases: Vec<Phase> = reports.iter().map(|p| p.phase).collect();
    assert_eq!(phases.first(), Some(&Phase::Prepare));
    assert!(phases.contains(&Phase::Checksum));
    assert_eq!(
        reports.last().map(|p| (p.phase, p.fraction)),
        Some((Phase::Done, Some(1.0)))
    );
}

#[test]
fn failed_build_leaves_nothing_behind() {
    // Arrange
    let (_dir, store) = store();
    let failing = FakeBuilder {
        fill: 1,
        fail: true,
    };

    // Act
    let err = build(&store, &failing, "debian").unwrap_err();

    // Assert
    assert!(matches!(err, StoreError::Build { .. }), "{err}");
    assert!(err.to_string().contains("needs root"));
    assert!(entries(&store).is_empty(), "{:?}", entries(&store));
    assert!(matches!(
        store.get("debian"),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn failed_rebuild_keeps_the_previous_image() {
    // Arrange
    let (_dir, store) = store();
    let first = build(&store, &ok(1), "debian").unwrap();

    // Act
    let result = build(
        &store,
        &FakeBuilder {
            fill: 2,
            fail: true,
        },
        "debian",
    );

    // Assert
    assert!(result.is_err());
    assert_eq!(store.get("debian").unwrap().manifest, first);
    assert_eq!(entries(&store), ["debian"]);
}

#[test]
fn rebuild_replaces_the_image_and_removes_the_old_one() {
    // Arrange
    let (_dir, store) = store();
    let first = build(&store, &ok(1), "debian").unwrap();

    // Act
    let second = build(&store, &ok(2), "debian").unwrap();

    // Assert
    assert_ne!(first.sha256, second.sha256);
    assert_eq!(store.get("debian").unwrap().manifest.sha256, second.sha256);
    assert_eq!(entries(&store), ["debian"]);
}

#[test]
fn stale_staging_of_a_dead_build_is_cleaned_and_never_listed() {
    // Arrange: a staging dir as a killed build (pid that cannot exist) leaves it
    let (_dir, store) = store();
    let stale = store.images_dir().join(".build-debian-2147483647-0");
    fs::create_dir_all(stale.join("work/root/etc")).unwrap();
    fs::write(stale.join(MANIFEST_FILE), b"{}").unwrap();

    // Act
    let listed_before = store.list().unwrap();
    build(&store, &ok(1), "other").unwrap();

    // Assert
    assert!(listed_before.is_empty());
    assert!(!stale.exists());
    assert_eq!(entries(&store), ["other"]);
}

#[test]
fn list_sorts_by_name_and_remove_deletes_one_image() {
    // Arrange
    let (_dir, store) = store();
    build(&store, &ok(1), "zeta").unwrap();
    build(&store, &ok(2), "alpha").unwrap();

    // Act
    let names: Vec<String> = store.list().unwrap().into_iter().map(|m| m.name).collect();
    let removed = store.remove("zeta").unwrap();

    // Assert
    assert_eq!(names, ["alpha", "zeta"]);
    assert_eq!(removed.name, "zeta");
    assert_eq!(entries(&store), ["alpha"]);
}

#[test]
fn unknown_and_invalid_names_give_clear_errors() {
    // Arrange
    let (_dir, store) = store();
    build(&store, &ok(1), "debian").unwrap();

    // Act
    let unknown = store.remove("ubuntu").unwrap_err();
    let invalid = store.get("../debian").unwrap_err();

    // Assert
    assert!(
        unknown.to_string().contains("\"ubuntu\" not found"),
        "{unknown}"
    );
    assert!(matches!(invalid, StoreError::Spec(SpecError::Name(_))));
}

#[test]
fn directories_without_a_manifest_are_not_images_and_are_left_alone() {
    // Arrange: the default initramfs lives in images/default/
    let (_dir, store) = store();
    let default = store.images_dir().join("default");
    fs::create_dir_all(&default).unwrap();
    fs::write(default.join("initramfs.cpio.gz"), b"cpio").unwrap();

    // Act
    let listed = store.list().unwrap();
    let removed = store.remove("default");
    let rebuilt = build(&store, &ok(1), "default");

    // Assert
    assert!(listed.is_empty());
    assert!(matches!(removed, Err(StoreError::NotAnImage { .. })));
    assert!(matches!(rebuilt, Err(StoreError::NotAnImage { .. })));
    assert_eq!(
        fs::read(default.join("initramfs.cpio.gz")).unwrap(),
        b"cpio"
    );
}

#[test]
fn truncated_or_foreign_image_files_are_reported_as_damaged() {
    // Arrange
    let (_dir, store) = store();
    build(&store, &ok(1), "short").unwrap();
    build(&store, &ok(1), "foreign").unwrap();
    let short = store.images_dir().join("short/rootfs.ext4");
    fs::OpenOptions::new()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(100)
        .unwrap();
    fs::write(
        store.images_dir().join("foreign/rootfs.ext4"),
        vec![0u8; 4096],
    )
    .unwrap();

    // Act
    let short_err = store.get("short").unwrap_err();
    let foreign_err = store.get("foreign").unwrap_err();

    // Assert
    assert!(
        short_err.to_string().contains("is 100 bytes"),
        "{short_err}"
    );
    assert!(
        foreign_err.to_string().contains("not an ext4"),
        "{foreign_err}"
    );
}

#[test]
fn verify_notices_changed_content_of_the_same_length() {
    // Arrange
    let (_dir, store) = store();
    build(&store, &ok(1), "debian").unwrap();
    let rootfs = store.images_dir().join("debian/rootfs.ext4");
    fs::write(&rootfs, ok(9).image_bytes()).unwrap();

    // Act
    let err = store.verify("debian").unwrap_err();

    // Assert
    assert!(err.to_string().contains("sha256"), "{err}");
}

#[test]
fn missing_store_lists_empty() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = ImageStore::new(dir.path().join("nowhere"));

    // Act
    let listed = store.list().unwrap();

    // Assert
    assert!(listed.is_empty());
}

#[test]
fn staging_names_are_parsed_for_their_owner() {
    // Arrange / Act / Assert
    assert_eq!(staging_owner(".build-debian-12-0"), Some(12));
    assert_eq!(staging_owner(".trash-my-image-7-3"), Some(7));
    assert_eq!(staging_owner(".build--12-0"), None);
    assert_eq!(staging_owner("debian"), None);
    assert_eq!(staging_owner(".build-x-notapid-0"), None);
}
