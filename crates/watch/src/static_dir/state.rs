//! The directory's files with their last good objects, and reading them: which files changed,
//! which texts must be parsed, and which file defines the effective version of every object.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub(super) use super::entry::FileEntry;
use super::entry::{digest, Stamp};
use super::parse::{par_map, parse_file_in, FileObjects};
use super::{StaticDirError, FILE_EXTENSIONS};
use model::event::{Kind, Object, SourceEvent};
use model::objects::{Interner, Slice, Svc};
use model::sorted::SortedVec;

/// Everything the directory holds at one point in time.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Services, by file name order then document order, duplicates resolved.
    pub services: Vec<Arc<Svc>>,
    /// EndpointSlices, likewise.
    pub endpoint_slices: Vec<Arc<Slice>>,
    /// This node's Node object (read or synthesized).
    pub node: Node,
    /// True if `node` was synthesized because the directory has no matching Node.
    pub node_synthesized: bool,
    /// Files read successfully (or kept from their last good version), in order (the
    /// source's own paths, not copies).
    pub files: Vec<FileKey>,
    /// Warnings: ignored kinds, duplicates, missing labels, files kept from a previous read.
    pub warnings: Vec<String>,
}

impl Snapshot {
    /// The name of this node's Node object. This equals the host's node name unless the
    /// directory holds exactly one Node with another name, which is then used for this host.
    pub fn node_name(&self) -> &str {
        self.node.metadata.name.as_deref().unwrap_or_default()
    }

    /// The objects as a full relist: `Init`, `InitApply` per object, `InitDone`, for Node,
    /// Service and EndpointSlice in that order.
    pub fn events(&self) -> Vec<SourceEvent> {
        relist_events(
            self.node.clone(),
            self.services.iter().cloned(),
            self.endpoint_slices.iter().cloned(),
        )
    }
}

/// A full relist: `Init`, `InitApply` per object, `InitDone`, for Node, Service and
/// EndpointSlice in that order (the snapshot's and [`DirState::relist`]'s one form).
pub(super) fn relist_events(
    node: Node,
    services: impl Iterator<Item = Arc<Svc>>,
    slices: impl Iterator<Item = Arc<Slice>>,
) -> Vec<SourceEvent> {
    let mut ev = Vec::with_capacity(7 + services.size_hint().0 + slices.size_hint().0);
    ev.push(SourceEvent::Init(Kind::Node));
    ev.push(SourceEvent::InitApply(Object::Node(Box::new(node))));
    ev.push(SourceEvent::InitDone(Kind::Node));
    ev.push(SourceEvent::Init(Kind::Service));
    ev.extend(services.map(|s| SourceEvent::InitApply(Object::Service(s))));
    ev.push(SourceEvent::InitDone(Kind::Service));
    ev.push(SourceEvent::Init(Kind::EndpointSlice));
    ev.extend(slices.map(|s| SourceEvent::InitApply(Object::EndpointSlice(s))));
    ev.push(SourceEvent::InitDone(Kind::EndpointSlice));
    ev
}

/// Namespace/name of an object (a Service's key shares its object's strings).
pub(super) type ObjKey = (Arc<str>, Arc<str>);

pub(super) fn service_key(s: &Svc) -> ObjKey {
    (s.name.namespace.clone(), s.name.name.clone())
}

pub(super) fn slice_key(s: &Slice) -> ObjKey {
    (s.namespace.clone(), s.name.clone())
}

/// A file's path as the key of the source's tables, compared, ordered and hashed by its bytes:
/// for the files of one directory that is the name order `Path`'s component-wise comparison
/// gives, at a fraction of its cost (splitting both paths into components on every comparison
/// was ~7 % of reading a directory of 20,000 files).
#[derive(Debug, Clone)]
pub struct FileKey(Arc<Path>);

impl FileKey {
    fn new(path: &Path) -> FileKey {
        FileKey(Arc::from(path))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for FileKey {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl PartialEq for FileKey {
    fn eq(&self, other: &FileKey) -> bool {
        self.0.as_os_str() == other.0.as_os_str()
    }
}

impl Eq for FileKey {}

impl PartialOrd for FileKey {
    fn partial_cmp(&self, other: &FileKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for FileKey {
    fn cmp(&self, other: &FileKey) -> std::cmp::Ordering {
        self.0.as_os_str().cmp(other.0.as_os_str())
    }
}

impl std::hash::Hash for FileKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.as_os_str().hash(h);
    }
}

impl std::borrow::Borrow<OsStr> for FileKey {
    fn borrow(&self) -> &OsStr {
        self.0.as_os_str()
    }
}

/// What a batch learned about one file.
#[derive(Debug)]
pub(super) enum Update {
    /// The file is gone (or no longer a candidate).
    Gone,
    /// The file was read (`parsed` is `None` when the text is unchanged since the last read).
    Read {
        hash: NonZeroU64,
        stamp: Option<Stamp>,
        parsed: Option<Result<FileObjects, StaticDirError>>,
    },
    /// The file could not be read.
    Unreadable(StaticDirError),
}

/// Counters of the work the source did (for tests and benchmarks: one changed file must cost
/// one file's parse).
#[derive(Debug, Default)]
pub struct SourceStats {
    files_read: AtomicU64,
    files_parsed: AtomicU64,
    rescans: AtomicU64,
}

impl SourceStats {
    /// Files read from disk so far.
    pub fn files_read(&self) -> u64 {
        self.files_read.load(Ordering::Relaxed)
    }
    /// Files parsed so far (a file whose text did not change is read, not parsed).
    pub fn files_parsed(&self) -> u64 {
        self.files_parsed.load(Ordering::Relaxed)
    }
    /// Full directory rescans so far (start, inotify overflow, ConfigMap `..data` swaps,
    /// polling rounds).
    pub fn rescans(&self) -> u64 {
        self.rescans.load(Ordering::Relaxed)
    }
}

/// The outcome of one batch of file changes.
#[derive(Debug, Default)]
pub struct Batch {
    /// Watch-like events for the objects whose effective version changed.
    pub events: Vec<SourceEvent>,
    /// Errors of files that could not be read or parsed (their last good objects are kept).
    pub errors: Vec<StaticDirError>,
    /// Warnings (ignored kinds, duplicates, files kept from their last good version).
    pub warnings: Vec<String>,
}

/// The directory's files with their last good contents, and which file defines the effective
/// version of every object. Pure apart from [`DirState::scan`] and [`DirState::read_paths`].
#[derive(Debug)]
pub struct DirState {
    pub(super) dir: PathBuf,
    pub(super) node_name: String,
    /// Boxed: a B-tree node holds eleven entries whatever its fill, about half of them used
    /// when files are added in name order (at 20,000 files of the earlier ~180-byte entries
    /// the unboxed map took 7.4 MB; a [`FileEntry`] is now 40 bytes, ~1.9 MB with the tree).
    /// Its paths are shared with the definitions below (one allocation per path).
    pub(super) files: BTreeMap<FileKey, Box<FileEntry>>,
    /// For every Service / EndpointSlice, the files defining it (nearly always one); the last
    /// one (name order) wins, like on a full read.
    pub(super) service_defs: HashMap<ObjKey, SortedVec<FileKey>>,
    pub(super) slice_defs: HashMap<ObjKey, SortedVec<FileKey>>,
    /// The Node last chosen (see [`Snapshot::node_name`]).
    pub(super) node: Option<Node>,
    /// Node and zone names of all files' slices.
    pub(super) names: Interner,
    pub(super) stats: Arc<SourceStats>,
}

/// The result of one full read: the snapshot plus the errors of files that were skipped.
#[derive(Debug)]
pub struct LoadResult {
    /// The objects.
    pub snapshot: Snapshot,
    /// Errors of the files that were skipped or kept from their previous version.
    pub errors: Vec<StaticDirError>,
}

/// Whether a file name is one the source reads (not hidden, a known extension).
pub(super) fn is_candidate_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    if name.starts_with('.') {
        return false;
    }
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|ext| FILE_EXTENSIONS.contains(&ext))
}

/// A file due to be read: its `stat` stamp, whether the source knows it, and the hash of
/// its last read text.
struct ToRead {
    path: PathBuf,
    /// Digest of the stamp of its last read, when unchanged stamps skip the read (polling).
    skip_stamp: Option<NonZeroU64>,
    known: bool,
    hash: Option<NonZeroU64>,
}

impl ToRead {
    /// Checks the file (a regular file, its `stat` changed when stamps are compared), reads it
    /// and parses its text unless it equals the last read one. `None` when there is nothing to
    /// report: unchanged, or not a file and never known. Runs on the workers, so the `stat` of
    /// 20,000 files is parallel too, and is taken from the open file (one system call fewer a
    /// file than a `stat` by name before reading).
    fn read(self, stats: &SourceStats, names: &Mutex<Interner>) -> Option<(PathBuf, Update)> {
        use std::io::Read;
        let gone = |p: PathBuf, known: bool| known.then_some((p, Update::Gone));
        let mut file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return gone(self.path, self.known)
            }
            // Not readable: an error if it is a file, else not a candidate.
            Err(source) => {
                if !std::fs::metadata(&self.path).is_ok_and(|m| m.is_file()) {
                    return gone(self.path, self.known);
                }
                stats.files_read.fetch_add(1, Ordering::Relaxed);
                let err = StaticDirError::ReadFile {
                    path: self.path.clone(),
                    source,
                };
                return Some((self.path, Update::Unreadable(err)));
            }
        };
        let meta = match file.metadata() {
            Ok(m) if m.is_file() => m,
            _ => return gone(self.path, self.known),
        };
        let stamp = Stamp::of(&meta);
        if self.skip_stamp.is_some() && self.skip_stamp == Some(stamp.digest()) {
            return None;
        }
        stats.files_read.fetch_add(1, Ordering::Relaxed);
        let mut text = String::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
        match file.read_to_string(&mut text) {
            Ok(_) => {
                drop(file);
                let hash = hash_text(&text);
                let parsed = (self.hash != Some(hash)).then(|| {
                    stats.files_parsed.fetch_add(1, Ordering::Relaxed);
                    parse_file_in(&self.path, &text, names)
                });
                drop(text);
                let update = Update::Read {
                    hash,
                    stamp: Some(stamp),
                    parsed,
                };
                Some((self.path, update))
            }
            Err(source) => {
                let err = StaticDirError::ReadFile {
                    path: self.path.clone(),
                    source,
                };
                Some((self.path, Update::Unreadable(err)))
            }
        }
    }
}

fn hash_text(text: &str) -> NonZeroU64 {
    digest(&text)
}

impl DirState {
    /// An empty state for `dir` on the node named `node_name`.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> DirState {
        DirState {
            dir: dir.into(),
            node_name: node_name.into(),
            files: BTreeMap::new(),
            service_defs: HashMap::new(),
            slice_defs: HashMap::new(),
            node: None,
            names: Interner::default(),
            stats: Arc::default(),
        }
    }

    /// The work counters.
    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// Reads `paths` (which may have changed, appeared or vanished) and applies them as one
    /// batch. A path whose text is unchanged since its last read is not parsed. With `stamps`,
    /// a path whose `stat` is unchanged is not even read (the polling fallback).
    pub fn read_paths(&mut self, paths: &BTreeSet<PathBuf>, stamps: bool) -> Batch {
        self.read_list(paths.iter().cloned(), stamps)
    }

    /// [`DirState::read_paths`] of paths in name order (taken, not copied: a first scan's
    /// 20,000 paths would otherwise exist twice, and the copies freed below the long-lived
    /// entries would be holes in the heap).
    fn read_list(&mut self, paths: impl IntoIterator<Item = PathBuf>, stamps: bool) -> Batch {
        let mut updates: Vec<(PathBuf, Update)> = Vec::new();
        let mut to_read: Vec<ToRead> = Vec::new();
        for path in paths {
            let known = self.files.get(path.as_os_str());
            if !is_candidate_name(&path) {
                if known.is_some() {
                    updates.push((path, Update::Gone));
                }
                continue;
            }
            to_read.push(ToRead {
                path,
                skip_stamp: known.and_then(|e| e.stamp).filter(|_| stamps),
                known: known.is_some(),
                hash: known.and_then(|e| e.hash),
            });
        }
        // Each file is checked, read, hashed and parsed by the same worker, so only the texts
        // being parsed are in memory, never the whole directory's.
        // The workers convert objects with the directory's interner, so no object holds
        // private copies of shared strings that the main thread would free again.
        let stats = &self.stats;
        let names = Mutex::new(std::mem::take(&mut self.names));
        let read = par_map(to_read, |r| r.read(stats, &names));
        self.names = names.into_inner().unwrap_or_else(|e| e.into_inner());
        updates.extend(read.into_iter().flatten());
        self.apply(updates)
    }

    /// Lists the directory and applies every file that appeared, changed or vanished as one
    /// batch (unchanged texts are not parsed; with `stamps`, unchanged `stat`s are not read).
    pub fn scan(&mut self, stamps: bool) -> Result<Batch, StaticDirError> {
        self.stats.rescans.fetch_add(1, Ordering::Relaxed);
        let read_dir_err = |source| StaticDirError::ReadDir {
            dir: self.dir.clone(),
            source,
        };
        let mut paths: Vec<PathBuf> = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let path = entry.map_err(read_dir_err)?.path();
            if is_candidate_name(&path) {
                paths.push(path);
            }
        }
        // Files known before and not listed now are gone.
        paths.extend(self.files.keys().map(|p| p.path().to_path_buf()));
        // Name order, compared as bytes like the file table's keys (a `BTreeSet<PathBuf>`
        // compares component by component).
        paths.sort_unstable_by(|a, b| a.as_os_str().cmp(b.as_os_str()));
        paths.dedup();
        let first = self.files.is_empty();
        let batch = self.read_list(paths, stamps);
        if first {
            // Built one insert at a time in name order, the table's nodes are about half
            // full; rebuilt from its sorted entries they are full (~0.4 MB less at 20,000
            // files).
            self.files = std::mem::take(&mut self.files).into_iter().collect();
        }
        Ok(batch)
    }

    /// The effective Service `key` (the last definition in name order).
    pub(super) fn service(&self, key: &ObjKey) -> Option<&Arc<Svc>> {
        let path = self.service_defs.get(key)?.last()?;
        self.files.get(path.path().as_os_str())?.service(key)
    }

    /// The effective EndpointSlice `key`.
    pub(super) fn slice(&self, key: &ObjKey) -> Option<&Arc<Slice>> {
        let path = self.slice_defs.get(key)?.last()?;
        self.files.get(path.path().as_os_str())?.slice(key)
    }

    pub(super) fn unindex(&mut self, path: &Path) {
        let Some((path, e)) = self.files.get_key_value(path.as_os_str()) else {
            return;
        };
        let path = path.clone();
        let services = e.services().iter().map(|s| service_key(s));
        let slices = e.endpoint_slices().iter().map(|s| slice_key(s));
        for k in services {
            unindex_one(&mut self.service_defs, &k, &path);
        }
        for k in slices {
            unindex_one(&mut self.slice_defs, &k, &path);
        }
    }

    pub(super) fn index(&mut self, path: &Path) {
        let Some((path, e)) = self.files.get_key_value(path.as_os_str()) else {
            return;
        };
        for s in e.services() {
            self.service_defs
                .entry(service_key(s))
                .or_default()
                .insert(path.clone());
        }
        for s in e.endpoint_slices() {
            self.slice_defs
                .entry(slice_key(s))
                .or_default()
                .insert(path.clone());
        }
    }
}

/// The entry of file `path` in `files`, made empty if it is not there (its path is then stored
/// once, and shared by the definitions index).
pub(super) fn file_mut<'a>(
    files: &'a mut BTreeMap<FileKey, Box<FileEntry>>,
    path: &Path,
) -> &'a mut FileEntry {
    let key = match files.get_key_value(path.as_os_str()) {
        Some((k, _)) => k.clone(),
        None => FileKey::new(path),
    };
    files.entry(key).or_default()
}

/// Drops `path` from the files defining `k` (and `k` when no file is left).
fn unindex_one(defs: &mut HashMap<ObjKey, SortedVec<FileKey>>, k: &ObjKey, path: &FileKey) {
    if let Some(set) = defs.get_mut(k) {
        set.remove(path);
        if set.is_empty() {
            defs.remove(k);
        }
    }
}

/// A bare Node named `name` with the `kubernetes.io/hostname` label (no addresses, no zone).
pub fn synthesize_node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/hostname".to_string(),
                name.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// Reads `dir` once (no watching): for `plan` and `--once`. Files are parsed in parallel.
pub fn load(dir: &Path, node_name: &str) -> Result<LoadResult, StaticDirError> {
    let mut state = DirState::new(dir, node_name);
    let batch = state.scan(false)?;
    Ok(LoadResult {
        snapshot: state.snapshot(),
        errors: batch.errors,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::static_dir::parse::parse_file;

    /// A Service `ns/name` with one TCP port (also for the entry tests).
    pub(in crate::static_dir) fn svc(name: &str, port: u16) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: ns\nspec:\n  \
             clusterIP: 10.96.0.1\n  ports:\n  - port: {port}\n    protocol: TCP\n"
        )
    }

    fn slice(name: &str, svc: &str, ip: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  \
             namespace: ns\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\n\
             endpoints:\n- addresses:\n  - {ip}\n"
        )
    }

    fn read(path: &str, text: &str) -> (PathBuf, Update) {
        let parsed = Some(parse_file(Path::new(path), text));
        let hash = hash_text(text);
        let update = Update::Read {
            hash,
            stamp: None,
            parsed,
        };
        (PathBuf::from(path), update)
    }

    #[test]
    fn relist_equals_the_snapshots_events() {
        let mut st = DirState::new("/d", "node-a");
        let node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n";
        st.apply(vec![
            read(
                "/d/a.yaml",
                &[svc("x", 80), slice("x-1", "x", "10.0.0.1")].join("---\n"),
            ),
            // Redefined in a later file and twice within one file: the last one wins.
            read(
                "/d/b.yaml",
                &[svc("x", 81), svc("y", 80), svc("y", 82)].join("---\n"),
            ),
            read("/d/c.yaml", &slice("x-1", "x", "10.0.0.2")),
            read("/d/n.yaml", node),
            read("/d/z.yaml", "kind: [unclosed"),
        ]);
        // A file that goes bad keeps its last good objects.
        st.apply(vec![read("/d/c.yaml", "kind: [unclosed")]);
        let relist = st.relist();
        assert_eq!(relist, st.snapshot().events());
        let services: Vec<(String, i32)> = (relist.iter())
            .filter_map(|e| match e {
                SourceEvent::InitApply(Object::Service(s)) => Some((
                    s.name.name.to_string(),
                    s.spec.as_ref()?.ports.as_ref()?.first()?.port,
                )),
                _ => None,
            })
            .collect();
        assert_eq!(services, [("x".to_string(), 81), ("y".to_string(), 82)]);
        let ips: Vec<String> = (relist.iter())
            .filter_map(|e| match e {
                SourceEvent::InitApply(Object::EndpointSlice(s)) => {
                    Some(s.endpoints.first()?.ip.to_string())
                }
                _ => None,
            })
            .collect();
        assert_eq!(ips, ["10.0.0.2"]);
    }
}
