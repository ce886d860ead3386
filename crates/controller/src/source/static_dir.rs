//! The static directory source: Services, EndpointSlices and Nodes read from YAML files.
//!
//! `kube-ipvs --source-dir DIR` turns kube-ipvs into a declarative IPVS manager without a
//! cluster. Every regular file (or symlink to one) directly in `DIR` whose name ends in `.yaml`,
//! `.yml` or `.json` and does not start with `.` is read, in name order. A file may hold several
//! YAML documents (`---`) and `kind: List` (or `ServiceList`, ...) documents whose `items` are
//! objects. Services, EndpointSlices (`discovery.k8s.io/v1`) and Nodes (`v1`) are kept; other
//! kinds are ignored with a warning. Namespaced objects without a namespace get `default`.
//!
//! Errors never stop the source. A file that cannot be read or has a bad document is reported
//! (naming the file and the document number) and skipped as a whole; on a re-read, a file that
//! became bad keeps contributing the objects of its last good version, so a half-saved edit does
//! not withdraw services. Two objects of the same kind and namespace/name: the later file wins
//! (warning).
//!
//! The Node: only this node's Node object matters. The Node named like this host (the node name
//! given to [`StaticDirSource::new`]) is used; if there is none and the directory holds exactly
//! one Node, that one is used (so the bundled examples work on any host, see
//! [`Snapshot::node_name`]); otherwise a bare Node named after the host is synthesized
//! (label `kubernetes.io/hostname` only, no addresses).
//!
//! Incremental, like a watch: at start the directory is read (files parsed in parallel) and
//! emitted as a list (`Init`/`InitApply`.../`InitDone` for Node, Service and EndpointSlice in
//! that order). Then the directory is watched with inotify (the `notify` crate): the paths an
//! event names are collected (bounded, see `MAX_PENDING_PATHS`), debounced (default 200 ms of
//! quiet, at most 4× that after the first change), and only those files are re-read; a file
//! whose text did not change is not parsed again. The objects whose effective version changed
//! are emitted as `Apply`/`Delete`, so one changed file costs that file's parse and its
//! objects' events. A rename or an object moving between files emits nothing unless the
//! object changed. Kubernetes ConfigMap volumes (files are symlinks through a `..data` symlink
//! that is swapped atomically): a change to a `..` name, an inotify queue overflow or a watch
//! error rescans the directory (every file read, only changed texts parsed). Without inotify
//! (no instance or watch available), the source logs it and polls every 2 s, skipping files
//! whose `stat` did not change.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use notify::{RecursiveMode, Watcher};
use serde_json::Value;
use tokio::sync::mpsc;

use super::{Kind, Object, SourceEvent};
use crate::objects::{Interner, Slice, Svc};

/// Default debounce between a directory change and the re-read.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(200);

/// File name extensions the source reads.
pub const FILE_EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// Label an EndpointSlice must carry to belong to a Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Errors of the static directory source.
#[derive(Debug, thiserror::Error)]
pub enum StaticDirError {
    /// The directory could not be listed.
    #[error("reading directory {}: {source}", dir.display())]
    ReadDir {
        /// The directory.
        dir: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A file could not be read.
    #[error("reading {}: {source}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A file is not valid YAML.
    #[error("{}: invalid YAML: {message}", path.display())]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A document (counting non-empty documents from 1; `item` for `kind: List` items, from 0)
    /// is not a valid object of its kind.
    #[error("{}: document {document}{}: {message}", path.display(), item.map(|i| format!(" item {i}")).unwrap_or_default())]
    Document {
        /// The file.
        path: PathBuf,
        /// Document number, from 1.
        document: usize,
        /// Item index inside a `List` document, from 0.
        item: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// The task reading the directory failed (a bug: it panicked).
    #[error("reading {}: the reader task failed: {message}", dir.display())]
    Reader {
        /// The directory.
        dir: PathBuf,
        /// What happened.
        message: String,
    },
    /// Watching the directory for changes failed.
    #[error("watching {}: {message}", dir.display())]
    Watch {
        /// The directory.
        dir: PathBuf,
        /// The watcher's message.
        message: String,
    },
}

/// The objects of one file, in the compact form the proxy keeps ([`crate::objects`]): the
/// parsed `k8s-openapi` objects are dropped as soon as they are converted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileObjects {
    /// Services, in document order.
    pub services: Vec<Svc>,
    /// EndpointSlices, in document order.
    pub endpoint_slices: Vec<Slice>,
    /// Nodes, in document order.
    pub nodes: Vec<Node>,
    /// Warnings (ignored kinds, missing labels), each naming the file and document.
    pub warnings: Vec<String>,
}

/// Parser limits scaled to the input: serde-saphyr's defaults (1,024 documents, 250,000 nodes
/// per file) would reject a directory generated for 10,000 services. Without aliases a node or
/// event needs at least one input byte, so these bounds only cut off alias expansion, which
/// keeps serde-saphyr's own alias/anchor caps.
fn parse_options(text: &str) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = budget.max_documents.max(text.len() / 8);
    budget.max_nodes = budget.max_nodes.max(text.len());
    budget.max_events = budget.max_events.max(text.len().saturating_mul(2));
    serde_saphyr::options! { budget: Some(budget) }
}

/// A document of one of the three kinds the source keeps, deserialized straight from YAML
/// (k8s-openapi's deserializers check `apiVersion` and `kind`, so the first that matches wins).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum TypedDoc {
    Service(Box<Service>),
    EndpointSlice(Box<EndpointSlice>),
    Node(Box<Node>),
}

/// The fast path of [`parse_file`]: every document is a valid Service, EndpointSlice or Node,
/// deserialized without an intermediate `serde_json::Value`. `None` when anything else is in
/// the file (Lists, other kinds, empty documents, errors): the general path then parses it and
/// words the errors.
fn parse_typed(path: &Path, text: &str) -> Option<FileObjects> {
    let docs: Vec<TypedDoc> =
        serde_saphyr::from_multiple_with_options(text, parse_options(text)).ok()?;
    let mut out = FileObjects::default();
    for (i, doc) in docs.into_iter().enumerate() {
        let where_ = || format!("{}: document {}", path.display(), i + 1);
        let meta = match &doc {
            TypedDoc::Service(s) => &s.metadata,
            TypedDoc::EndpointSlice(s) => &s.metadata,
            TypedDoc::Node(n) => &n.metadata,
        };
        if meta.name.as_deref().unwrap_or_default().is_empty() {
            return None;
        }
        match doc {
            TypedDoc::Service(s) => accept_service(*s, &where_, &mut out),
            TypedDoc::EndpointSlice(s) => accept_slice(*s, &where_, &mut out),
            TypedDoc::Node(n) => out.nodes.push(*n),
        }
    }
    Some(out)
}

fn accept_service(mut svc: Service, where_: &dyn Fn() -> String, out: &mut FileObjects) {
    svc.metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    if let Some(label) = super::excluding_label(svc.metadata.labels.as_ref()) {
        tracing::info!(object = %where_(), label, "Service not handled by this proxy");
        return;
    }
    out.services.push(Svc::from_service(&svc));
}

fn accept_slice(mut eps: EndpointSlice, where_: &dyn Fn() -> String, out: &mut FileObjects) {
    eps.metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    if let Some(label) = super::excluding_label(eps.metadata.labels.as_ref()) {
        tracing::info!(object = %where_(), label, "EndpointSlice not handled by this proxy");
        return;
    }
    let has_label = eps
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(SERVICE_NAME_LABEL));
    if !has_label {
        out.warnings.push(format!(
            "{}: EndpointSlice {} has no {SERVICE_NAME_LABEL} label and belongs to no Service",
            where_(),
            eps.metadata.name.as_deref().unwrap_or_default()
        ));
    }
    out.endpoint_slices.push(Slice::of(&eps));
}

/// Parses one file's text. `path` is only used in messages.
pub fn parse_file(path: &Path, text: &str) -> Result<FileObjects, StaticDirError> {
    if let Some(out) = parse_typed(path, text) {
        return Ok(out);
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(text, parse_options(text))
        .map_err(|e| StaticDirError::Yaml {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let mut out = FileObjects::default();
    for (i, doc) in docs.into_iter().enumerate() {
        let document = i + 1;
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
        if kind == "List" || (kind.ends_with("List") && doc.get("items").is_some()) {
            let items = match doc.get("items") {
                Some(Value::Array(items)) => items.clone(),
                Some(Value::Null) | None => Vec::new(),
                Some(_) => {
                    return Err(StaticDirError::Document {
                        path: path.to_path_buf(),
                        document,
                        item: None,
                        message: "items: expected a list".into(),
                    })
                }
            };
            for (j, item) in items.into_iter().enumerate() {
                add_object(path, document, Some(j), item, &mut out)?;
            }
        } else {
            add_object(path, document, None, doc, &mut out)?;
        }
    }
    Ok(out)
}

fn add_object(
    path: &Path,
    document: usize,
    item: Option<usize>,
    doc: Value,
    out: &mut FileObjects,
) -> Result<(), StaticDirError> {
    let err = |message: String| StaticDirError::Document {
        path: path.to_path_buf(),
        document,
        item,
        message,
    };
    let where_ = || {
        format!(
            "{}: document {document}{}",
            path.display(),
            item.map(|i| format!(" item {i}")).unwrap_or_default()
        )
    };
    if !doc.is_object() {
        return Err(err(
            "expected a mapping (an object with apiVersion and kind)".into(),
        ));
    }
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let api_version = doc
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if kind.is_empty() {
        return Err(err("missing kind".into()));
    }
    let name_missing = |meta: &ObjectMeta| meta.name.as_deref().unwrap_or_default().is_empty();
    match kind.as_str() {
        "Service" | "EndpointSlice" | "Node" => {
            let expected = if kind == "EndpointSlice" {
                "discovery.k8s.io/v1"
            } else {
                "v1"
            };
            if api_version != expected {
                return Err(err(format!(
                    "{kind}: apiVersion {api_version:?} is not supported (expected {expected:?})"
                )));
            }
        }
        _ => {
            out.warnings.push(format!(
                "{}: ignoring {kind} ({api_version}): only Service, EndpointSlice and Node are read",
                where_()
            ));
            return Ok(());
        }
    }
    match kind.as_str() {
        "Service" => {
            let svc: Service =
                serde_path_to_error::deserialize(doc).map_err(|e| err(format!("Service: {e}")))?;
            if name_missing(&svc.metadata) {
                return Err(err("Service: metadata.name is missing".into()));
            }
            accept_service(svc, &where_, out);
        }
        "EndpointSlice" => {
            let eps: EndpointSlice = serde_path_to_error::deserialize(doc)
                .map_err(|e| err(format!("EndpointSlice: {e}")))?;
            if name_missing(&eps.metadata) {
                return Err(err("EndpointSlice: metadata.name is missing".into()));
            }
            accept_slice(eps, &where_, out);
        }
        _ => {
            let node: Node =
                serde_path_to_error::deserialize(doc).map_err(|e| err(format!("Node: {e}")))?;
            if name_missing(&node.metadata) {
                return Err(err("Node: metadata.name is missing".into()));
            }
            out.nodes.push(node);
        }
    }
    Ok(())
}

/// Everything the directory holds at one point in time.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Services, by file name order then document order, duplicates resolved.
    pub services: Vec<Svc>,
    /// EndpointSlices, likewise.
    pub endpoint_slices: Vec<Slice>,
    /// This node's Node object (read or synthesized).
    pub node: Node,
    /// True if `node` was synthesized because the directory has no matching Node.
    pub node_synthesized: bool,
    /// Files read successfully (or kept from their last good version), in order.
    pub files: Vec<PathBuf>,
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
        let mut ev = Vec::with_capacity(self.services.len() + self.endpoint_slices.len() + 7);
        ev.push(SourceEvent::Init(Kind::Node));
        ev.push(SourceEvent::InitApply(Object::Node(Box::new(
            self.node.clone(),
        ))));
        ev.push(SourceEvent::InitDone(Kind::Node));
        ev.push(SourceEvent::Init(Kind::Service));
        ev.extend(
            self.services
                .iter()
                .map(|s| SourceEvent::InitApply(Object::Service(Box::new(s.clone())))),
        );
        ev.push(SourceEvent::InitDone(Kind::Service));
        ev.push(SourceEvent::Init(Kind::EndpointSlice));
        ev.extend(
            self.endpoint_slices
                .iter()
                .map(|s| SourceEvent::InitApply(Object::EndpointSlice(Box::new(s.clone())))),
        );
        ev.push(SourceEvent::InitDone(Kind::EndpointSlice));
        ev
    }
}

/// Namespace/name of an object.
type ObjKey = (String, String);

fn service_key(s: &Svc) -> ObjKey {
    (s.name.namespace.to_string(), s.name.name.to_string())
}

fn slice_key(s: &Slice) -> ObjKey {
    (s.namespace.to_string(), s.name.to_string())
}

/// A file's identity and change stamp from `stat` (following symlinks), used by the polling
/// fallback to skip files that did not change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}

/// One file as the source knows it.
#[derive(Debug, Default)]
struct FileEntry {
    /// Hash of the text read last (good or bad): the same text is never parsed twice.
    hash: Option<u64>,
    /// `stat` of the last read.
    stamp: Option<Stamp>,
    /// The objects of its last good version.
    objects: FileObjects,
    /// Index of the last document defining each Service / EndpointSlice in `objects`.
    service_at: HashMap<ObjKey, usize>,
    slice_at: HashMap<ObjKey, usize>,
    /// The last read failed (its last good objects are kept).
    bad: bool,
    /// A read succeeded at least once (`objects` is a real version, not the empty default).
    has_good: bool,
}

impl FileEntry {
    /// Keeps `objects` as the file's last good version, node and zone names shared through
    /// `names` with the rest of the directory.
    fn set_objects(&mut self, mut objects: FileObjects, names: &mut Interner) {
        for s in &mut objects.endpoint_slices {
            s.intern(names);
        }
        self.service_at = objects
            .services
            .iter()
            .enumerate()
            .map(|(i, s)| (service_key(s), i))
            .collect();
        self.slice_at = objects
            .endpoint_slices
            .iter()
            .enumerate()
            .map(|(i, s)| (slice_key(s), i))
            .collect();
        self.objects = objects;
    }
}

/// What a batch learned about one file.
#[derive(Debug)]
enum Update {
    /// The file is gone (or no longer a candidate).
    Gone,
    /// The file was read (`parsed` is `None` when the text is unchanged since the last read).
    Read {
        hash: u64,
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
    dir: PathBuf,
    node_name: String,
    files: BTreeMap<PathBuf, FileEntry>,
    /// For every Service / EndpointSlice, the files defining it; the last one (name order)
    /// wins, like on a full read.
    service_defs: HashMap<ObjKey, BTreeSet<PathBuf>>,
    slice_defs: HashMap<ObjKey, BTreeSet<PathBuf>>,
    /// The Node last chosen (see [`Snapshot::node_name`]).
    node: Option<Node>,
    /// Node and zone names of all files' slices.
    names: Interner,
    stats: Arc<SourceStats>,
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
fn is_candidate_name(path: &Path) -> bool {
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

fn hash_text(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// A file read and due to be parsed: its path, the hash of its text, and the text.
type ToParse = (PathBuf, u64, String);

/// Parses files, on several threads when there are many. Each text is dropped as soon as it
/// is parsed, so the whole directory's text is never held next to all of its objects.
fn parse_all(texts: Vec<ToParse>) -> Vec<(PathBuf, u64, Result<FileObjects, StaticDirError>)> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(texts.len() / 16)
        .max(1);
    if threads == 1 {
        return texts
            .into_iter()
            .map(|(p, h, t)| {
                let r = parse_file(&p, &t);
                (p, h, r)
            })
            .collect();
    }
    let chunk = texts.len().div_ceil(threads);
    let mut texts = texts;
    let mut chunks = Vec::new();
    while !texts.is_empty() {
        let rest = texts.split_off(chunk.min(texts.len()));
        chunks.push(std::mem::replace(&mut texts, rest));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|c| {
                scope.spawn(move || {
                    c.into_iter()
                        .map(|(p, h, t)| {
                            let r = parse_file(&p, &t);
                            (p, h, r)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            match h.join() {
                Ok(v) => out.extend(v),
                // A parser panic is a bug; the files of that chunk count as unreadable.
                Err(_) => tracing::error!(source = "static-dir", "a parser thread panicked"),
            }
        }
        out
    })
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
        let mut updates: Vec<(PathBuf, Update)> = Vec::new();
        let mut to_parse: Vec<ToParse> = Vec::new();
        let mut stamps_of: HashMap<PathBuf, Option<Stamp>> = HashMap::new();
        for path in paths {
            let meta = std::fs::metadata(path);
            let candidate = is_candidate_name(path) && meta.as_ref().is_ok_and(|m| m.is_file());
            if !candidate {
                if self.files.contains_key(path) {
                    updates.push((path.clone(), Update::Gone));
                }
                continue;
            }
            let stamp = meta.ok().map(|m| Stamp::of(&m));
            if stamps {
                if let Some(e) = self.files.get(path) {
                    if e.stamp.is_some() && e.stamp == stamp {
                        continue;
                    }
                }
            }
            self.stats.files_read.fetch_add(1, Ordering::Relaxed);
            match std::fs::read_to_string(path) {
                Ok(text) => {
                    let hash = hash_text(&text);
                    if self.files.get(path).and_then(|e| e.hash) == Some(hash) {
                        updates.push((
                            path.clone(),
                            Update::Read {
                                hash,
                                stamp,
                                parsed: None,
                            },
                        ));
                    } else {
                        stamps_of.insert(path.clone(), stamp);
                        to_parse.push((path.clone(), hash, text));
                    }
                }
                Err(source) => {
                    if source.kind() == std::io::ErrorKind::NotFound {
                        if self.files.contains_key(path) {
                            updates.push((path.clone(), Update::Gone));
                        }
                    } else {
                        updates.push((
                            path.clone(),
                            Update::Unreadable(StaticDirError::ReadFile {
                                path: path.clone(),
                                source,
                            }),
                        ));
                    }
                }
            }
        }
        self.stats
            .files_parsed
            .fetch_add(to_parse.len() as u64, Ordering::Relaxed);
        for (path, hash, parsed) in parse_all(to_parse) {
            let stamp = stamps_of.remove(&path).flatten();
            updates.push((
                path,
                Update::Read {
                    hash,
                    stamp,
                    parsed: Some(parsed),
                },
            ));
        }
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
        let mut paths: BTreeSet<PathBuf> = BTreeSet::new();
        for entry in std::fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let path = entry.map_err(read_dir_err)?.path();
            if is_candidate_name(&path) {
                paths.insert(path);
            }
        }
        // Files known before and not listed now are gone.
        paths.extend(self.files.keys().cloned());
        Ok(self.read_paths(&paths, stamps))
    }

    /// The effective Service `key` (the last definition in name order).
    fn service(&self, key: &ObjKey) -> Option<&Svc> {
        let path = self.service_defs.get(key)?.last()?;
        let e = self.files.get(path)?;
        e.objects.services.get(*e.service_at.get(key)?)
    }

    /// The effective EndpointSlice `key`.
    fn slice(&self, key: &ObjKey) -> Option<&Slice> {
        let path = self.slice_defs.get(key)?.last()?;
        let e = self.files.get(path)?;
        e.objects.endpoint_slices.get(*e.slice_at.get(key)?)
    }

    fn unindex(&mut self, path: &Path) {
        let Some(e) = self.files.get(path) else {
            return;
        };
        for (defs, keys) in [
            (&mut self.service_defs, e.service_at.keys()),
            (&mut self.slice_defs, e.slice_at.keys()),
        ] {
            for k in keys {
                if let Some(set) = defs.get_mut(k) {
                    set.remove(path);
                    if set.is_empty() {
                        defs.remove(k);
                    }
                }
            }
        }
    }

    fn index(&mut self, path: &Path) {
        let Some(e) = self.files.get(path) else {
            return;
        };
        for k in e.service_at.keys() {
            self.service_defs
                .entry(k.clone())
                .or_default()
                .insert(path.to_path_buf());
        }
        for k in e.slice_at.keys() {
            self.slice_defs
                .entry(k.clone())
                .or_default()
                .insert(path.to_path_buf());
        }
    }

    /// Applies a batch of file updates and returns the events of the objects whose effective
    /// version changed: `Apply` for new or changed ones, `Delete` for those no file defines
    /// any more. An object moving between files, or a file renamed, emits nothing unless the
    /// effective object changed.
    fn apply(&mut self, updates: Vec<(PathBuf, Update)>) -> Batch {
        let mut batch = Batch::default();
        // The objects the batch may change, with their effective version before it.
        let mut services: BTreeMap<ObjKey, Option<Svc>> = BTreeMap::new();
        let mut slices: BTreeMap<ObjKey, Option<Slice>> = BTreeMap::new();
        let mut note = |this: &DirState, objs: &FileObjects| {
            for s in &objs.services {
                let k = service_key(s);
                if let std::collections::btree_map::Entry::Vacant(v) = services.entry(k) {
                    let before = this.service(v.key()).cloned();
                    v.insert(before);
                }
            }
            for s in &objs.endpoint_slices {
                let k = slice_key(s);
                if let std::collections::btree_map::Entry::Vacant(v) = slices.entry(k) {
                    let before = this.slice(v.key()).cloned();
                    v.insert(before);
                }
            }
        };
        for (path, u) in &updates {
            if let Some(e) = self.files.get(path) {
                note(self, &e.objects);
            }
            if let Update::Read {
                parsed: Some(Ok(objs)),
                ..
            } = u
            {
                note(self, objs);
            }
        }
        let mut changed_files: Vec<PathBuf> = Vec::new();
        for (path, u) in updates {
            match u {
                Update::Gone => {
                    self.unindex(&path);
                    self.files.remove(&path);
                    changed_files.push(path);
                }
                Update::Unreadable(e) => {
                    if self.files.contains_key(&path) {
                        batch.warnings.push(format!(
                            "{}: keeping the objects of its last good version",
                            path.display()
                        ));
                    }
                    batch.errors.push(e);
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: None,
                } => {
                    let e = self.files.entry(path).or_default();
                    e.hash = Some(hash);
                    e.stamp = stamp;
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: Some(Err(err)),
                } => {
                    let e = self.files.entry(path.clone()).or_default();
                    e.hash = Some(hash);
                    e.stamp = stamp;
                    e.bad = true;
                    if e.has_good {
                        batch.warnings.push(format!(
                            "{}: keeping the objects of its last good version",
                            path.display()
                        ));
                    }
                    batch.errors.push(err);
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: Some(Ok(objs)),
                } => {
                    self.unindex(&path);
                    batch.warnings.extend(objs.warnings.iter().cloned());
                    let e = self.files.entry(path.clone()).or_default();
                    e.hash = Some(hash);
                    e.stamp = stamp;
                    e.bad = false;
                    e.has_good = true;
                    e.set_objects(objs, &mut self.names);
                    self.index(&path);
                    changed_files.push(path);
                }
            }
        }
        // Node first, then Services before their slices; deletions last.
        let node = self.choose_node(&mut batch.warnings);
        if self.node.as_ref() != Some(&node) {
            batch
                .events
                .push(SourceEvent::Apply(Object::Node(Box::new(node.clone()))));
            self.node = Some(node);
        }
        let mut service_deletes = Vec::new();
        let mut slice_deletes = Vec::new();
        for (k, before) in services {
            let after = self.service(&k);
            if self.service_defs.get(&k).is_some_and(|d| d.len() > 1) {
                batch.warnings.push(format!(
                    "Service {}/{} is defined in several files; the last one wins: {}",
                    k.0,
                    k.1,
                    self.defined_in(&self.service_defs, &k)
                ));
            }
            match (before, after) {
                (before, Some(after)) if before.as_ref() != Some(after) => batch
                    .events
                    .push(SourceEvent::Apply(Object::Service(Box::new(after.clone())))),
                (Some(before), None) => {
                    service_deletes.push(SourceEvent::Delete(Object::Service(Box::new(before))))
                }
                _ => {}
            }
        }
        for (k, before) in slices {
            let after = self.slice(&k);
            if self.slice_defs.get(&k).is_some_and(|d| d.len() > 1) {
                batch.warnings.push(format!(
                    "EndpointSlice {}/{} is defined in several files; the last one wins: {}",
                    k.0,
                    k.1,
                    self.defined_in(&self.slice_defs, &k)
                ));
            }
            match (before, after) {
                (before, Some(after)) if before.as_ref() != Some(after) => {
                    batch
                        .events
                        .push(SourceEvent::Apply(Object::EndpointSlice(Box::new(
                            after.clone(),
                        ))))
                }
                (Some(before), None) => {
                    slice_deletes.push(SourceEvent::Delete(Object::EndpointSlice(Box::new(before))))
                }
                _ => {}
            }
        }
        batch.events.extend(slice_deletes);
        batch.events.extend(service_deletes);
        batch
    }

    fn defined_in(&self, defs: &HashMap<ObjKey, BTreeSet<PathBuf>>, k: &ObjKey) -> String {
        defs.get(k)
            .map(|d| {
                d.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    }

    /// This node's Node: the one named like the host; else the only Node; else a bare one.
    fn choose_node(&self, warnings: &mut Vec<String>) -> Node {
        let mut nodes: BTreeMap<&str, &Node> = BTreeMap::new();
        for e in self.files.values() {
            for n in &e.objects.nodes {
                nodes.insert(n.metadata.name.as_deref().unwrap_or_default(), n);
            }
        }
        if let Some(n) = nodes.get(self.node_name.as_str()) {
            return (*n).clone();
        }
        if nodes.len() == 1 {
            if let Some(n) = nodes.values().next() {
                return (*n).clone();
            }
        }
        if !nodes.is_empty() {
            warnings.push(format!(
                "{} Nodes in the directory and none named {:?}; using a bare Node",
                nodes.len(),
                self.node_name
            ));
        }
        synthesize_node(&self.node_name)
    }

    /// Everything the state holds, in file name then document order.
    pub fn snapshot(&self) -> Snapshot {
        let mut warnings = Vec::new();
        let mut services: BTreeMap<ObjKey, (usize, Svc)> = BTreeMap::new();
        let mut slices: BTreeMap<ObjKey, (usize, Slice)> = BTreeMap::new();
        let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
        let mut seq = 0usize;
        let mut files = Vec::new();
        for (path, e) in &self.files {
            if !e.has_good {
                continue;
            }
            if e.bad {
                warnings.push(format!(
                    "{}: keeping the objects of its last good version",
                    path.display()
                ));
            }
            files.push(path.clone());
            let objs = &e.objects;
            warnings.extend(objs.warnings.iter().cloned());
            for s in &objs.services {
                seq += 1;
                let k = service_key(s);
                if services.insert(k.clone(), (seq, s.clone())).is_some() {
                    warnings.push(format!(
                        "{}: Service {}/{} redefined; this later definition wins",
                        path.display(),
                        k.0,
                        k.1
                    ));
                }
            }
            for s in &objs.endpoint_slices {
                seq += 1;
                let k = slice_key(s);
                if slices.insert(k.clone(), (seq, s.clone())).is_some() {
                    warnings.push(format!(
                        "{}: EndpointSlice {}/{} redefined; this later definition wins",
                        path.display(),
                        k.0,
                        k.1
                    ));
                }
            }
            for n in &objs.nodes {
                let name = n.metadata.name.clone().unwrap_or_default();
                if nodes.insert(name.clone(), n.clone()).is_some() {
                    warnings.push(format!(
                        "{}: Node {name} redefined; this later definition wins",
                        path.display()
                    ));
                }
            }
        }
        // Keep file/document order (the order a human wrote them in), not name order.
        let mut services: Vec<_> = services.into_values().collect();
        services.sort_by_key(|(seq, _)| *seq);
        let mut slices: Vec<_> = slices.into_values().collect();
        slices.sort_by_key(|(seq, _)| *seq);
        let node = self.choose_node(&mut warnings);
        let node_synthesized = !nodes.contains_key(self.node_name.as_str()) && nodes.len() != 1;
        Snapshot {
            services: services.into_iter().map(|(_, s)| s).collect(),
            endpoint_slices: slices.into_iter().map(|(_, s)| s).collect(),
            node,
            node_synthesized,
            files,
            warnings,
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

/// Most changed paths remembered between two batches; beyond, the next batch rescans the
/// directory (bounded memory whatever happens in the directory).
const MAX_PENDING_PATHS: usize = 4096;

/// Default polling interval when inotify is unavailable.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// What the watcher saw since the last batch.
#[derive(Debug, Default)]
struct PendingState {
    paths: BTreeSet<PathBuf>,
    rescan: bool,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// Changes queued by the inotify callback for the source task.
#[derive(Debug, Default)]
struct Pending {
    state: std::sync::Mutex<PendingState>,
    wake: tokio::sync::Notify,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one watcher event (called on notify's thread).
    fn record(&self, dir: &Path, res: notify::Result<notify::Event>) {
        use notify::event::{AccessKind, AccessMode, EventKind};
        let mut st = self.lock();
        match res {
            Err(e) => {
                tracing::warn!(source = "static-dir", "watch error: {e}; rescanning");
                st.rescan = true;
            }
            Ok(ev) => {
                match ev.kind {
                    // Opening or reading a file changes nothing (and the source's own reads
                    // would otherwise re-trigger it forever); a close after writing does.
                    EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
                    EventKind::Access(_) => return,
                    EventKind::Other | EventKind::Any => st.rescan = true,
                    _ => {}
                }
                if ev.need_rescan() {
                    st.rescan = true;
                }
                for path in ev.paths {
                    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    if path.parent() != Some(dir) || name.starts_with("..") {
                        // The directory itself, or a ConfigMap volume's `..data` swap: every
                        // file may have changed.
                        st.rescan = true;
                    } else if is_candidate_name(&path) {
                        if st.paths.len() >= MAX_PENDING_PATHS {
                            st.rescan = true;
                            st.paths.clear();
                        }
                        if !st.rescan {
                            st.paths.insert(path);
                        }
                    } else {
                        // Hidden files (editors' temporaries) and other extensions.
                        continue;
                    }
                }
                if !st.rescan && st.paths.is_empty() {
                    return;
                }
            }
        }
        let now = Instant::now();
        st.first.get_or_insert(now);
        st.last = Some(now);
        drop(st);
        self.wake.notify_one();
    }

    /// Waits until something is pending and has been quiet for `debounce` (at most
    /// `4 × debounce` after the first change), then takes it.
    async fn take(&self, debounce: Duration) -> PendingState {
        loop {
            let deadline = {
                let st = self.lock();
                match (st.first, st.last) {
                    (Some(first), Some(last)) => Some((last + debounce).min(first + debounce * 4)),
                    _ => None,
                }
            };
            match deadline {
                None => self.wake.notified().await,
                Some(d) if Instant::now() >= d => {
                    let mut st = self.lock();
                    let mut taken = std::mem::take(&mut *st);
                    if taken.rescan {
                        taken.paths.clear();
                    }
                    return taken;
                }
                Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
            }
        }
    }
}

/// The static directory source: reads the directory, then watches it.
#[derive(Debug, Clone)]
pub struct StaticDirSource {
    dir: PathBuf,
    node_name: String,
    debounce: Duration,
    poll: Option<Duration>,
    stats: Arc<SourceStats>,
}

fn log_batch(batch: &Batch) {
    for w in &batch.warnings {
        tracing::warn!(source = "static-dir", "{w}");
    }
    for e in &batch.errors {
        tracing::error!(source = "static-dir", "skipping file: {e}");
    }
}

fn log_result(result: &LoadResult) {
    for w in &result.snapshot.warnings {
        tracing::warn!(source = "static-dir", "{w}");
    }
    for e in &result.errors {
        tracing::error!(source = "static-dir", "skipping file: {e}");
    }
}

/// Runs blocking directory work off the async workers, moving the state in and out.
async fn blocking<T: Send + 'static>(
    mut state: DirState,
    f: impl FnOnce(&mut DirState) -> T + Send + 'static,
) -> Result<(DirState, T), StaticDirError> {
    let dir = state.dir.clone();
    tokio::task::spawn_blocking(move || {
        let out = f(&mut state);
        (state, out)
    })
    .await
    .map_err(|e| StaticDirError::Reader {
        dir,
        message: e.to_string(),
    })
}

impl StaticDirSource {
    /// A source for `dir` on the node named `node_name`.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            node_name: node_name.into(),
            debounce: DEFAULT_DEBOUNCE,
            poll: None,
            stats: Arc::default(),
        }
    }

    /// Sets the debounce between a change and the re-read.
    pub fn with_debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// Polls every `interval` instead of using inotify (what the source falls back to when
    /// inotify is unavailable).
    pub fn with_polling(mut self, interval: Duration) -> Self {
        self.poll = Some(interval);
        self
    }

    /// The work counters of this source (shared with its running task).
    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the directory once, logging warnings and skipped files.
    pub fn load(&self) -> Result<LoadResult, StaticDirError> {
        let result = load(&self.dir, &self.node_name)?;
        log_result(&result);
        Ok(result)
    }

    /// Emits the directory's objects as a list (`Init`/`InitApply`/`InitDone` per kind), then,
    /// like a watch, `Apply`/`Delete` for the objects each change alters; a change re-reads
    /// only the files it touched.
    ///
    /// Returns `Ok(())` when `tx`'s receiver is dropped. Fails if the directory cannot be read
    /// or watched at start; later read failures (e.g. the directory vanished) are logged and the
    /// last state is kept.
    pub async fn run(self, tx: mpsc::Sender<SourceEvent>) -> Result<(), StaticDirError> {
        let watch_err = |e: notify::Error| StaticDirError::Watch {
            dir: self.dir.clone(),
            message: e.to_string(),
        };
        let pending = Arc::new(Pending::default());
        let mut poll = self.poll;
        let mut _watcher = None;
        if poll.is_none() {
            let p = pending.clone();
            let dir = self.dir.clone();
            let watcher =
                notify::recommended_watcher(move |res| p.record(&dir, res)).and_then(|mut w| {
                    // Watch before the first read, so no change between the two is missed.
                    w.watch(&self.dir, RecursiveMode::NonRecursive).map(|()| w)
                });
            match watcher {
                Ok(w) => _watcher = Some(w),
                Err(e) if !self.dir.is_dir() => return Err(watch_err(e)),
                Err(e) => {
                    tracing::warn!(
                        source = "static-dir",
                        dir = %self.dir.display(),
                        interval_s = DEFAULT_POLL_INTERVAL.as_secs_f64(),
                        "inotify unavailable ({e}): polling the directory instead"
                    );
                    poll = Some(DEFAULT_POLL_INTERVAL);
                }
            }
        } else if !self.dir.is_dir() {
            return Err(StaticDirError::Watch {
                dir: self.dir.clone(),
                message: "not a directory".into(),
            });
        }

        let mut state = DirState::new(&self.dir, &self.node_name);
        state.stats = self.stats.clone();
        let (state_back, first) = blocking(state, |s| s.scan(false)).await?;
        state = state_back;
        let first = first?;
        log_batch(&first);
        let snapshot = state.snapshot();
        tracing::info!(
            source = "static-dir",
            dir = %self.dir.display(),
            files = snapshot.files.len(),
            services = snapshot.services.len(),
            endpoint_slices = snapshot.endpoint_slices.len(),
            node = snapshot.node_name(),
            "read static directory"
        );
        for ev in snapshot.events() {
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
        drop(snapshot);
        loop {
            let (rescan, paths) = match poll {
                Some(interval) => {
                    tokio::select! {
                        _ = tx.closed() => return Ok(()),
                        () = tokio::time::sleep(interval) => {}
                    }
                    (true, BTreeSet::new())
                }
                None => {
                    let taken = tokio::select! {
                        _ = tx.closed() => return Ok(()),
                        t = pending.take(self.debounce) => t,
                    };
                    (taken.rescan, taken.paths)
                }
            };
            let stamps = poll.is_some();
            let (state_back, result) = blocking(state, move |s| {
                if rescan {
                    s.scan(stamps)
                } else {
                    Ok(s.read_paths(&paths, false))
                }
            })
            .await?;
            state = state_back;
            let batch = match result {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(source = "static-dir", "{e}; keeping the last state");
                    continue;
                }
            };
            log_batch(&batch);
            if batch.events.is_empty() {
                tracing::debug!(source = "static-dir", "files changed, objects did not");
                continue;
            }
            tracing::info!(
                source = "static-dir",
                changes = batch.events.len(),
                "static directory changed"
            );
            for ev in batch.events {
                if tx.send(ev).await.is_err() {
                    return Ok(());
                }
            }
        }
    }
}
