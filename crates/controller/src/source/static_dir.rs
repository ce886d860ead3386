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
//! The directory is watched with inotify (the `notify` crate). Changes are debounced (default
//! 200 ms), the directory is re-read, and if the resulting objects differ from the last emitted
//! ones, a full relist is emitted: `Init`/`InitApply`.../`InitDone` for Node, Service and
//! EndpointSlice in that order. Kubernetes ConfigMap volumes (files are symlinks through a
//! `..data` symlink that is swapped atomically) work because the swap is a change in `DIR`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use notify::{RecursiveMode, Watcher};
use serde_json::Value;
use tokio::sync::mpsc;

use super::{Kind, Object, SourceEvent};

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
    /// Watching the directory for changes failed.
    #[error("watching {}: {message}", dir.display())]
    Watch {
        /// The directory.
        dir: PathBuf,
        /// The watcher's message.
        message: String,
    },
}

/// The objects of one file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileObjects {
    /// Services, in document order.
    pub services: Vec<Service>,
    /// EndpointSlices, in document order.
    pub endpoint_slices: Vec<EndpointSlice>,
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

/// Parses one file's text. `path` is only used in messages.
pub fn parse_file(path: &Path, text: &str) -> Result<FileObjects, StaticDirError> {
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
            let mut svc: Service =
                serde_json::from_value(doc).map_err(|e| err(format!("Service: {e}")))?;
            if name_missing(&svc.metadata) {
                return Err(err("Service: metadata.name is missing".into()));
            }
            svc.metadata
                .namespace
                .get_or_insert_with(|| "default".into());
            if let Some(label) = super::excluding_label(svc.metadata.labels.as_ref()) {
                tracing::info!(object = %where_(), label, "Service not handled by this proxy");
                return Ok(());
            }
            out.services.push(svc);
        }
        "EndpointSlice" => {
            let mut eps: EndpointSlice =
                serde_json::from_value(doc).map_err(|e| err(format!("EndpointSlice: {e}")))?;
            if name_missing(&eps.metadata) {
                return Err(err("EndpointSlice: metadata.name is missing".into()));
            }
            eps.metadata
                .namespace
                .get_or_insert_with(|| "default".into());
            if let Some(label) = super::excluding_label(eps.metadata.labels.as_ref()) {
                tracing::info!(object = %where_(), label, "EndpointSlice not handled by this proxy");
                return Ok(());
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
            out.endpoint_slices.push(eps);
        }
        _ => {
            let node: Node = serde_json::from_value(doc).map_err(|e| err(format!("Node: {e}")))?;
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
    pub services: Vec<Service>,
    /// EndpointSlices, likewise.
    pub endpoint_slices: Vec<EndpointSlice>,
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

    /// True if the objects (not the warnings or file list) are the same.
    fn same_objects(&self, other: &Snapshot) -> bool {
        self.services == other.services
            && self.endpoint_slices == other.endpoint_slices
            && self.node == other.node
    }
}

/// The directory's files with their last good contents; re-reads keep a file's last good
/// version when it turns bad.
#[derive(Debug, Default)]
struct DirState {
    files: BTreeMap<PathBuf, FileObjects>,
}

/// The result of one read: the snapshot plus the errors of files that were skipped.
#[derive(Debug)]
pub struct LoadResult {
    /// The objects.
    pub snapshot: Snapshot,
    /// Errors of the files that were skipped or kept from their previous version.
    pub errors: Vec<StaticDirError>,
}

fn is_candidate(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    if name.starts_with('.') {
        return false;
    }
    let Some(ext) = path.extension().and_then(|e| e.to_str()) else {
        return false;
    };
    FILE_EXTENSIONS.contains(&ext) && std::fs::metadata(path).is_ok_and(|m| m.is_file())
}

impl DirState {
    fn reload(&mut self, dir: &Path, node_name: &str) -> Result<LoadResult, StaticDirError> {
        let entries = std::fs::read_dir(dir).map_err(|source| StaticDirError::ReadDir {
            dir: dir.to_path_buf(),
            source,
        })?;
        let mut paths = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| StaticDirError::ReadDir {
                dir: dir.to_path_buf(),
                source,
            })?;
            let path = entry.path();
            if is_candidate(&path) {
                paths.push(path);
            }
        }
        paths.sort();
        let mut errors = Vec::new();
        let mut warnings = Vec::new();
        let mut files = BTreeMap::new();
        for path in paths {
            let parsed = std::fs::read_to_string(&path)
                .map_err(|source| StaticDirError::ReadFile {
                    path: path.clone(),
                    source,
                })
                .and_then(|text| parse_file(&path, &text));
            match parsed {
                Ok(objs) => {
                    files.insert(path, objs);
                }
                Err(e) => {
                    if let Some(prev) = self.files.remove(&path) {
                        warnings.push(format!(
                            "{}: keeping the objects of its last good version",
                            path.display()
                        ));
                        files.insert(path, prev);
                    }
                    errors.push(e);
                }
            }
        }
        self.files = files;
        let snapshot = self.snapshot(node_name, warnings);
        Ok(LoadResult { snapshot, errors })
    }

    fn snapshot(&self, node_name: &str, mut warnings: Vec<String>) -> Snapshot {
        let mut services: BTreeMap<(String, String), (usize, Service)> = BTreeMap::new();
        let mut slices: BTreeMap<(String, String), (usize, EndpointSlice)> = BTreeMap::new();
        let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
        let mut seq = 0usize;
        let key = |m: &ObjectMeta| {
            (
                m.namespace.clone().unwrap_or_default(),
                m.name.clone().unwrap_or_default(),
            )
        };
        for (path, objs) in &self.files {
            warnings.extend(objs.warnings.iter().cloned());
            for s in &objs.services {
                seq += 1;
                let k = key(&s.metadata);
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
                let k = key(&s.metadata);
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

        let (node, node_synthesized) = if let Some(n) = nodes.get(node_name) {
            (n.clone(), false)
        } else if nodes.len() == 1 {
            let n = nodes.into_values().next().unwrap_or_default();
            (n, false)
        } else {
            if !nodes.is_empty() {
                warnings.push(format!(
                    "{} Nodes in the directory and none named {node_name:?}; using a bare Node",
                    nodes.len()
                ));
            }
            (synthesize_node(node_name), true)
        };
        Snapshot {
            services: services.into_iter().map(|(_, s)| s).collect(),
            endpoint_slices: slices.into_iter().map(|(_, s)| s).collect(),
            node,
            node_synthesized,
            files: self.files.keys().cloned().collect(),
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

/// Reads `dir` once (no watching): for `plan` and `--once`.
pub fn load(dir: &Path, node_name: &str) -> Result<LoadResult, StaticDirError> {
    DirState::default().reload(dir, node_name)
}

/// The static directory source: reads the directory, then watches it.
#[derive(Debug, Clone)]
pub struct StaticDirSource {
    dir: PathBuf,
    node_name: String,
    debounce: Duration,
}

fn log_result(result: &LoadResult) {
    for w in &result.snapshot.warnings {
        tracing::warn!(source = "static-dir", "{w}");
    }
    for e in &result.errors {
        tracing::error!(source = "static-dir", "skipping file: {e}");
    }
}

impl StaticDirSource {
    /// A source for `dir` on the node named `node_name`.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            node_name: node_name.into(),
            debounce: DEFAULT_DEBOUNCE,
        }
    }

    /// Sets the debounce between a change and the re-read.
    pub fn with_debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
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

    /// Emits the directory's objects, then a full relist after every change that alters them.
    ///
    /// Returns `Ok(())` when `tx`'s receiver is dropped. Fails if the directory cannot be read
    /// or watched at start; later read failures (e.g. the directory vanished) are logged and the
    /// last state is kept.
    pub async fn run(self, tx: mpsc::Sender<SourceEvent>) -> Result<(), StaticDirError> {
        let watch_err = |e: notify::Error| StaticDirError::Watch {
            dir: self.dir.clone(),
            message: e.to_string(),
        };
        let (ntx, mut nrx) = mpsc::unbounded_channel::<()>();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            match &res {
                // notify's inotify mask includes IN_OPEN: the source's own reads would trigger
                // a re-read, forever. Opening a file changes nothing.
                Ok(ev)
                    if matches!(
                        ev.kind,
                        notify::EventKind::Access(notify::event::AccessKind::Open(_))
                    ) =>
                {
                    return
                }
                Err(e) => tracing::warn!(source = "static-dir", "watch error: {e}"),
                Ok(_) => {}
            }
            let _ = ntx.send(());
        })
        .map_err(watch_err)?;
        // Watch before the first read, so no change between the two is missed.
        watcher
            .watch(&self.dir, RecursiveMode::NonRecursive)
            .map_err(watch_err)?;

        let mut state = DirState::default();
        let first = state.reload(&self.dir, &self.node_name)?;
        log_result(&first);
        tracing::info!(
            source = "static-dir",
            dir = %self.dir.display(),
            services = first.snapshot.services.len(),
            endpoint_slices = first.snapshot.endpoint_slices.len(),
            node = first.snapshot.node_name(),
            "read static directory"
        );
        let mut last = first.snapshot;
        for ev in last.events() {
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
        loop {
            tokio::select! {
                _ = tx.closed() => return Ok(()),
                got = nrx.recv() => {
                    if got.is_none() {
                        return Err(StaticDirError::Watch {
                            dir: self.dir.clone(),
                            message: "the watcher stopped".into(),
                        });
                    }
                }
            }
            // Debounce: wait until the directory has been quiet for `debounce`.
            while let Ok(Some(())) = tokio::time::timeout(self.debounce, nrx.recv()).await {}
            match state.reload(&self.dir, &self.node_name) {
                Ok(result) => {
                    log_result(&result);
                    if result.snapshot.same_objects(&last) {
                        tracing::debug!(
                            source = "static-dir",
                            "directory changed, objects did not"
                        );
                        continue;
                    }
                    tracing::info!(
                        source = "static-dir",
                        services = result.snapshot.services.len(),
                        endpoint_slices = result.snapshot.endpoint_slices.len(),
                        "static directory changed"
                    );
                    last = result.snapshot;
                    for ev in last.events() {
                        if tx.send(ev).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                Err(e) => tracing::error!(source = "static-dir", "{e}; keeping the last state"),
            }
        }
    }
}
