//! Parsing one file's text into compact objects (a fast typed path, and a general path that
//! words every error with the file, document and item), and parsing many files in parallel.

use std::path::Path;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{StaticDirError, SERVICE_NAME_LABEL};
use model::objects::{Interner, Slice, Svc};
use smallvec::SmallVec;

/// The objects of one file, in the compact form the proxy keeps ([`model::objects`]): the
/// parsed `k8s-openapi` objects are dropped as soon as they are converted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileObjects {
    /// Services, in document order (shared with the events and the store). One is kept
    /// inline: most files hold one object, and a vector freed when the file's entry takes its
    /// object would leave a hole between long-lived objects.
    pub services: SmallVec<[Arc<Svc>; 1]>,
    /// EndpointSlices, in document order (shared likewise; one inline).
    pub endpoint_slices: SmallVec<[Arc<Slice>; 1]>,
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

/// The fast path of [`parse_file`]: every document is a valid Service, EndpointSlice or Node
/// in block style, deserialized straight into its type (the kind read from the document's
/// top-level `kind:` line first, so no document is buffered and tried against each type).
/// `None` when anything else is in the file (Lists, other kinds, empty documents, directives,
/// flow style, errors): the general path then parses it and words the errors.
fn parse_typed(path: &Path, text: &str, names: &Mutex<Interner>) -> Option<FileObjects> {
    let mut out = FileObjects::default();
    for (i, doc) in documents(text)?.into_iter().enumerate() {
        let where_ = || format!("{}: document {}", path.display(), i + 1);
        match top_level_kind(doc)? {
            "Service" => {
                let s: Service = typed(doc)?;
                named(&s.metadata)?;
                accept_service(s, &where_, &mut out, names);
            }
            "EndpointSlice" => {
                let s: EndpointSlice = typed(doc)?;
                named(&s.metadata)?;
                accept_slice(s, &where_, &mut out, names);
            }
            "Node" => {
                let n: Node = typed(doc)?;
                named(&n.metadata)?;
                out.nodes.push(n);
            }
            _ => return None,
        }
    }
    Some(out)
}

/// One document into its type: through the fast block reader ([`super::block`]) when it takes
/// the document and the value fits the type, else through serde-saphyr (which coerces scalars
/// to the field types and has the last word); `None` when neither gives the type.
fn typed<T: DeserializeOwned>(doc: &str) -> Option<T> {
    if let Some(value) = super::block::read(doc) {
        if let Ok(t) = T::deserialize(value) {
            return Some(t);
        }
    }
    serde_saphyr::from_str_with_options(doc, parse_options(doc)).ok()
}

/// `Some(())` when the object has a name (the general path words the error otherwise).
fn named(meta: &ObjectMeta) -> Option<()> {
    (!meta.name.as_deref().unwrap_or_default().is_empty()).then_some(())
}

/// The texts of a multi-document file's documents, split at `---` lines; `None` when the file
/// holds anything the split cannot be sure of (directives, `...` end markers, `---` followed
/// by content, documents without content): the YAML parser then splits it.
fn documents(text: &str) -> Option<Vec<&str>> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut first = true;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end();
        if bare.starts_with('%') || bare.starts_with("...") {
            return None;
        }
        if bare.starts_with("---") {
            if bare != "---" {
                return None;
            }
            let doc = &text[start..offset];
            // Only a preamble of comments and blank lines may stand before the first marker.
            if !first || has_content(doc) {
                docs.push(doc);
            }
            first = false;
            start = offset + line.len();
        }
        offset += line.len();
    }
    docs.push(&text[start..]);
    docs.iter().all(|d| has_content(d)).then_some(docs)
}

/// True when a document has a line that is neither blank nor a comment.
fn has_content(doc: &str) -> bool {
    doc.lines().any(|l| {
        let t = l.trim_start();
        !t.is_empty() && !t.starts_with('#')
    })
}

/// The value of a block-style document's one top-level `kind:` line (unquoted, without a
/// trailing comment); `None` when there is not exactly one.
fn top_level_kind(doc: &str) -> Option<&str> {
    let mut kinds = doc
        .lines()
        .filter_map(|l| l.strip_prefix("kind:"))
        .filter(|v| v.is_empty() || v.starts_with([' ', '\t']));
    let value = kinds.next()?;
    if kinds.next().is_some() {
        return None;
    }
    let value = value.split(" #").next().unwrap_or_default().trim();
    let unquoted = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
        .unwrap_or(value);
    Some(unquoted)
}

fn accept_service(
    mut svc: Service,
    where_: &dyn Fn() -> String,
    out: &mut FileObjects,
    names: &Mutex<Interner>,
) {
    svc.metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    if let Some(label) = model::event::excluding_label(svc.metadata.labels.as_ref()) {
        tracing::info!(object = %where_(), label, "Service not handled by this proxy");
        return;
    }
    let svc = Svc::from_service_in(&svc, &mut lock(names));
    out.services.push(Arc::new(svc));
}

fn accept_slice(
    mut eps: EndpointSlice,
    where_: &dyn Fn() -> String,
    out: &mut FileObjects,
    names: &Mutex<Interner>,
) {
    eps.metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    if let Some(label) = model::event::excluding_label(eps.metadata.labels.as_ref()) {
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
    let slice = Slice::from_slice_in(&eps, &mut lock(names));
    out.endpoint_slices.push(Arc::new(slice));
}

/// Parses one file's text. `path` is only used in messages.
pub fn parse_file(path: &Path, text: &str) -> Result<FileObjects, StaticDirError> {
    parse_file_in(path, text, &Mutex::default())
}

/// [`parse_file`] with the objects' shared strings (namespaces, port names, node names, ...)
/// taken from `names`, locked for each object's conversion only (the parse itself runs
/// unlocked, so workers parse in parallel).
pub(super) fn parse_file_in(
    path: &Path,
    text: &str,
    names: &Mutex<Interner>,
) -> Result<FileObjects, StaticDirError> {
    match parse_typed(path, text, names) {
        Some(out) => Ok(out),
        None => parse_general(path, text, names),
    }
}

/// The interner, also after a worker panicked while holding it (its table stays consistent:
/// a panic cannot stop an insert halfway).
fn lock(names: &Mutex<Interner>) -> std::sync::MutexGuard<'_, Interner> {
    names.lock().unwrap_or_else(|e| e.into_inner())
}

/// The general path of [`parse_file`]: every document through a `serde_json::Value`, Lists
/// expanded, every error worded with the file, document and item.
fn parse_general(
    path: &Path,
    text: &str,
    names: &Mutex<Interner>,
) -> Result<FileObjects, StaticDirError> {
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
                add_object(path, document, Some(j), item, &mut out, names)?;
            }
        } else {
            add_object(path, document, None, doc, &mut out, names)?;
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
    names: &Mutex<Interner>,
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
            accept_service(svc, &where_, out, names);
        }
        "EndpointSlice" => {
            let eps: EndpointSlice = serde_path_to_error::deserialize(doc)
                .map_err(|e| err(format!("EndpointSlice: {e}")))?;
            if name_missing(&eps.metadata) {
                return Err(err("EndpointSlice: metadata.name is missing".into()));
            }
            accept_slice(eps, &where_, out, names);
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

/// Maps `f` over `items` in order, on several threads when there are many (the directory's
/// files: each worker reads, hashes and parses its share).
pub(super) fn par_map<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(items.len() / 16)
        .max(1);
    if threads == 1 {
        return items.into_iter().map(f).collect();
    }
    let chunk = items.len().div_ceil(threads);
    let mut items = items;
    let mut chunks = Vec::new();
    while !items.is_empty() {
        let rest = items.split_off(chunk.min(items.len()));
        chunks.push(std::mem::replace(&mut items, rest));
    }
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|c| scope.spawn(move || c.into_iter().map(f).collect::<Vec<_>>()))
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

#[cfg(test)]
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - name: http\n    port: 80\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\n  nodeName: node-a\nports:\n- name: http\n  port: 8080\n";
    const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n";

    /// The fast path gives what the general path gives, or declines.
    fn same(text: &str) -> bool {
        let path = Path::new("t.yaml");
        let general = parse_general(path, text, &Mutex::default());
        match parse_typed(path, text, &Mutex::default()) {
            Some(fast) => {
                match general {
                    Ok(general) => assert_eq!(fast, general),
                    Err(e) => panic!("the fast path took what the general path rejects: {e}"),
                }
                true
            }
            None => false,
        }
    }

    /// Objects converted with one interner (the workers of a directory read) hold its
    /// strings from the start: the same namespace, protocol, port name and node name in two
    /// files are one allocation, whichever path parsed them, and no private copy is made.
    #[test]
    fn workers_convert_with_the_directorys_names() {
        let names = Mutex::default();
        let a = parse_file_in(Path::new("a.yaml"), &format!("{SVC}---\n{SLICE}"), &names).unwrap();
        // The general path (a List) takes the same strings.
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}\n- {}",
            SVC.trim_end().replace('\n', "\n  "),
            SLICE.trim_end().replace('\n', "\n  ")
        );
        let b = parse_file_in(Path::new("b.yaml"), &list, &names).unwrap();
        let (sa, sb) = (&a.services[0], &b.services[0]);
        assert_eq!(sa, sb);
        assert!(Arc::ptr_eq(&sa.name.namespace, &sb.name.namespace));
        let port = |s: &Svc| s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].clone();
        let (pa, pb) = (port(sa), port(sb));
        assert!(Arc::ptr_eq(
            pa.name.as_ref().unwrap(),
            pb.name.as_ref().unwrap()
        ));
        let (la, lb) = (&a.endpoint_slices[0], &b.endpoint_slices[0]);
        assert_eq!(la, lb);
        assert!(Arc::ptr_eq(&la.namespace, &lb.namespace));
        let service = |l: &Slice| l.service.clone().unwrap().namespace;
        assert!(Arc::ptr_eq(&service(la), &la.namespace));
        assert!(Arc::ptr_eq(&la.ports[0].name, pa.name.as_ref().unwrap()));
        let node = |l: &Slice| l.endpoints[0].node_name().unwrap().clone();
        assert!(Arc::ptr_eq(&node(la), &node(lb)));
        assert!(Arc::ptr_eq(
            la.endpoints[0].placement.as_ref().unwrap(),
            lb.endpoints[0].placement.as_ref().unwrap()
        ));
        // Without a shared interner each file has its own copies.
        let c = parse_file(Path::new("c.yaml"), SVC).unwrap();
        assert!(!Arc::ptr_eq(
            &c.services[0].name.namespace,
            &sa.name.namespace
        ));
    }

    #[test]
    fn fast_path_matches_the_general_path() {
        let multi = format!("{SVC}---\n{SLICE}---\n{NODE}");
        for text in [
            SVC.to_string(),
            SLICE.to_string(),
            multi.clone(),
            format!("# a preamble\n\n---\n{multi}"),
            format!("{SVC}--- \r\n{SLICE}"),
            SVC.replace("kind: Service", "kind: \"Service\" # quoted"),
            SVC.replace("kind: Service", "kind: 'Service'"),
            SLICE.replace("  labels:\n    kubernetes.io/service-name: web\n", ""),
            SVC.replace("  namespace: shop\n", ""),
            SVC.replace(
                "metadata:",
                "metadata:\n  labels:\n    service.kubernetes.io/service-proxy-name: other",
            ),
        ] {
            assert!(same(&text), "the fast path declined:\n{text}");
        }
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let mut taken = 0;
        for entry in std::fs::read_dir(examples).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                taken += usize::from(same(&text));
            }
        }
        assert!(taken >= 4, "the fast path took {taken} example files");
    }

    #[test]
    fn fast_path_declines_what_it_cannot_be_sure_of() {
        let list = "apiVersion: v1\nkind: List\nitems: []\n";
        for text in [
            list.to_string(),
            format!("{SVC}---\n---\n{SLICE}"),
            format!("{SVC}--- # comment\n{SLICE}"),
            format!("%YAML 1.2\n---\n{SVC}"),
            format!("{SVC}...\n"),
            format!("{SVC}kind: Service\n"),
            SVC.replace("kind: Service", "kind:Service"),
            "{apiVersion: v1, kind: Service, metadata: {name: a}}\n".to_string(),
            SVC.replace("kind: Service", "kind: ConfigMap"),
            SVC.replace("  name: web\n", ""),
            SVC.replace("apiVersion: v1", "apiVersion: v2"),
            String::new(),
        ] {
            assert!(!same(&text), "the fast path took:\n{text}");
        }
    }
}
