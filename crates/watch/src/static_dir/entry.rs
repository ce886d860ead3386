//! One file as the static source knows it: digests of its last text and `stat`, and the
//! objects of its last good version, kept compactly (a directory of 10,000 services holds
//! 20,000 of these).

use std::num::NonZeroU64;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::parse::FileObjects;
use super::state::{service_key, slice_key, ObjKey};
use model::objects::{Slice, Svc};
use model::sorted::SortedMap;

/// A file's identity and change stamp from `stat` (following symlinks), used by the polling
/// fallback to skip files that did not change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    /// Nanoseconds since the epoch, saturated (an i64 lasts until 2262; a stamp only has to
    /// differ when the file changed).
    mtime_ns: i64,
    ctime_ns: i64,
}

fn nanos(secs: i64, nsec: i64) -> i64 {
    secs.saturating_mul(1_000_000_000).saturating_add(nsec)
}

impl Stamp {
    pub(super) fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: nanos(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: nanos(meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// What a file's entry keeps of its stamp: a 64-bit digest (8 bytes instead of 48 a file;
    /// two different stamps of one file digest alike with a probability of 2^-64).
    pub(super) fn digest(&self) -> NonZeroU64 {
        digest(self)
    }
}

/// A 64-bit digest of `v`, never zero (zero is taken to one).
pub(super) fn digest(v: &impl std::hash::Hash) -> NonZeroU64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    NonZeroU64::new(h.finish()).unwrap_or(NonZeroU64::MIN)
}

/// Files with at most this many objects are searched by a scan, without an index.
pub(super) const SCAN_MAX: usize = 8;

/// Where each object of a large file is: the index of the last document defining it.
#[derive(Debug, Default)]
pub(super) struct FileIndex {
    services: SortedMap<ObjKey, usize>,
    slices: SortedMap<ObjKey, usize>,
}

/// The objects of a file's last good version. Nearly every file holds one Service or one
/// EndpointSlice and nothing else: that is kept as the object itself (16 bytes), anything more
/// in a box with its index.
#[derive(Debug, Default)]
pub(super) enum Held {
    /// No objects (or no good version yet).
    #[default]
    Nothing,
    /// Exactly one Service and nothing else.
    Service(Arc<Svc>),
    /// Exactly one EndpointSlice and nothing else.
    Slice(Arc<Slice>),
    /// Anything else.
    Many(Box<ManyObjects>),
}

/// The objects of a file holding more than one object, Nodes or warnings.
#[derive(Debug)]
pub(super) struct ManyObjects {
    objects: FileObjects,
    /// Index of the last document defining each object, only for a file holding more than
    /// [`SCAN_MAX`] objects: a small file is scanned, while a scan per key of a large
    /// multi-document file would make its change quadratic.
    index: Option<FileIndex>,
}

/// One file as the source knows it (40 bytes; a directory of 10,000 services holds 20,000).
#[derive(Debug, Default)]
pub(super) struct FileEntry {
    /// Digest of the text read last (good or bad): the same text is never parsed twice.
    pub(super) hash: Option<NonZeroU64>,
    /// Digest of the `stat` of the last read.
    pub(super) stamp: Option<NonZeroU64>,
    /// The objects of its last good version.
    objects: Held,
    /// The last read failed (its last good objects are kept).
    pub(super) bad: bool,
    /// A read succeeded at least once (`objects` is a real version, not the empty default).
    pub(super) has_good: bool,
}

impl FileEntry {
    /// Keeps `objects` as the file's last good version (converted with the directory's
    /// interner by the reader, so their names are already the shared ones).
    pub(super) fn set_objects(&mut self, mut objects: FileObjects) {
        let only = objects.nodes.is_empty() && objects.warnings.is_empty();
        self.objects = match (objects.services.len(), objects.endpoint_slices.len(), only) {
            (0, 0, true) => Held::Nothing,
            (1, 0, true) => match objects.services.pop() {
                Some(s) => Held::Service(s),
                None => Held::Nothing,
            },
            (0, 1, true) => match objects.endpoint_slices.pop() {
                Some(s) => Held::Slice(s),
                None => Held::Nothing,
            },
            (services, slices, _) => {
                let index = (services + slices > SCAN_MAX).then(|| FileIndex {
                    // Collecting keeps the last index of a repeated key: the last document wins.
                    services: (objects.services.iter().enumerate())
                        .map(|(i, s)| (service_key(s), i))
                        .collect(),
                    slices: (objects.endpoint_slices.iter().enumerate())
                        .map(|(i, s)| (slice_key(s), i))
                        .collect(),
                });
                Held::Many(Box::new(ManyObjects { objects, index }))
            }
        };
    }

    /// The file's Services, in document order.
    pub(super) fn services(&self) -> &[Arc<Svc>] {
        match &self.objects {
            Held::Service(s) => std::slice::from_ref(s),
            Held::Many(m) => &m.objects.services,
            Held::Nothing | Held::Slice(_) => &[],
        }
    }

    /// The file's EndpointSlices, in document order.
    pub(super) fn endpoint_slices(&self) -> &[Arc<Slice>] {
        match &self.objects {
            Held::Slice(s) => std::slice::from_ref(s),
            Held::Many(m) => &m.objects.endpoint_slices,
            Held::Nothing | Held::Service(_) => &[],
        }
    }

    /// The file's Nodes, in document order.
    pub(super) fn nodes(&self) -> &[Node] {
        match &self.objects {
            Held::Many(m) => &m.objects.nodes,
            _ => &[],
        }
    }

    /// The warnings of the file's last good version.
    pub(super) fn warnings(&self) -> &[String] {
        match &self.objects {
            Held::Many(m) => &m.objects.warnings,
            _ => &[],
        }
    }

    fn index(&self) -> Option<&FileIndex> {
        match &self.objects {
            Held::Many(m) => m.index.as_ref(),
            _ => None,
        }
    }

    /// The last document's Service `key` (a later document overrides an earlier one).
    pub(super) fn service(&self, key: &ObjKey) -> Option<&Arc<Svc>> {
        let services = self.services();
        match self.index() {
            Some(ix) => services.get(*ix.services.get(key)?),
            None => services
                .iter()
                .rev()
                .find(|s| *s.name.namespace == *key.0 && *s.name.name == *key.1),
        }
    }

    /// The last document's EndpointSlice `key`.
    pub(super) fn slice(&self, key: &ObjKey) -> Option<&Arc<Slice>> {
        let slices = self.endpoint_slices();
        match self.index() {
            Some(ix) => slices.get(*ix.slices.get(key)?),
            None => slices
                .iter()
                .rev()
                .find(|s| *s.namespace == *key.0 && *s.name == *key.1),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::static_dir::parse::parse_file;
    use crate::static_dir::state::tests::svc;

    fn entry(text: &str) -> FileEntry {
        let objects = parse_file(Path::new("f.yaml"), text).unwrap();
        let mut e = FileEntry::default();
        e.set_objects(objects);
        e
    }

    fn key(name: &str) -> ObjKey {
        (Arc::from("ns"), Arc::from(name))
    }

    #[test]
    fn a_file_of_one_object_keeps_just_that_object() {
        assert!(std::mem::size_of::<FileEntry>() <= 40);
        let one = entry(&svc("a", 80));
        assert!(matches!(one.objects, Held::Service(_)));
        assert_eq!(one.services().len(), 1);
        assert!(one.endpoint_slices().is_empty() && one.nodes().is_empty());
        assert_eq!(one.service(&key("a")).map(|s| &*s.name.name), Some("a"));
        assert!(one.service(&key("b")).is_none());
        assert!(matches!(entry("").objects, Held::Nothing));
    }

    #[test]
    fn larger_files_keep_document_order_and_the_last_definition_wins() {
        // Scanned (two documents) and indexed (more than SCAN_MAX): the same answers.
        for n in [2, SCAN_MAX + 3] {
            let mut text: Vec<String> = (0..n).map(|i| svc(&format!("s{i}"), 80)).collect();
            text.push(svc("s0", 81));
            let e = entry(&text.join("---\n"));
            assert!(matches!(e.objects, Held::Many(_)));
            assert_eq!(e.index().is_some(), n + 1 > SCAN_MAX, "{n}");
            assert_eq!(e.services().len(), n + 1);
            let s0 = e
                .service(&key("s0"))
                .and_then(|s| s.spec.as_ref()?.ports.clone());
            assert_eq!(s0.and_then(|p| p.first().map(|p| p.port)), Some(81), "{n}");
            assert!(e.service(&key(&format!("s{}", n - 1))).is_some());
        }
    }
}
