//! The static directory source: Services, EndpointSlices and Nodes read from YAML files.
//!
//! `kube-ipvs --source-dir DIR` turns kube-ipvs into a declarative IPVS manager without a
//! cluster. Every regular file (or symlink to one) directly in `DIR` whose name ends in `.yaml`,
//! `.yml` or `.json` and does not start with `.` is read, in name order. A file may hold several
//! YAML documents (`---`) and `kind: List` (or `ServiceList`, ...) documents whose `items` are
//! objects. Services, EndpointSlices (`discovery.k8s.io/v1`) and Nodes (`v1`) are kept; other
//! kinds are ignored with a warning. Namespaced objects without a namespace get `default`.
//! Documents in the plain block style that Kubernetes tools write are read by a fast reader
//! (`block`, ~5x faster); anything else by serde-saphyr, which also words every error.
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
//! Incremental, like a watch: at start the directory is read (files parsed in parallel, each
//! object converted with the directory's interner, so its namespace, port names and node names
//! are the shared ones from the start) and
//! emitted as a list (`Init`/`InitApply`.../`InitDone` for Node, Service and EndpointSlice in
//! that order). Then the directory is watched with inotify (the `notify` crate): the paths an
//! event names are collected (bounded, see `MAX_PENDING_PATHS`), debounced (default 200 ms of
//! quiet, at most 4× that after the first change; 20 ms when every changed file's last event
//! completed it: closed after writing, renamed into place, removed), and only those files are
//! re-read; a file whose text did not change is not parsed again. The objects whose effective version changed
//! are emitted as `Apply`/`Delete`, so one changed file costs that file's parse and its
//! objects' events. A rename or an object moving between files emits nothing unless the
//! object changed. Kubernetes ConfigMap volumes (files are symlinks through a `..data` symlink
//! that is swapped atomically): a change to a `..` name, an inotify queue overflow or a watch
//! error rescans the directory (every file read, only changed texts parsed). Without inotify
//! (no instance or watch available), the source logs it and polls every 2 s, skipping files
//! whose `stat` did not change.

use std::path::PathBuf;
use std::time::Duration;

mod apply;
mod block;
mod entry;
mod parse;
mod state;
mod watch;

pub use parse::{parse_file, FileObjects};
pub use state::{load, synthesize_node, Batch, DirState, LoadResult, Snapshot, SourceStats};
pub use watch::{StaticDirSource, DEFAULT_POLL_INTERVAL};

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
