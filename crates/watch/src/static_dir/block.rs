//! A fast reader for the plain block-style YAML that Kubernetes tools write (`kubectl get -o
//! yaml`, Helm, hand-written manifests), in front of serde-saphyr.
//!
//! serde-saphyr reads ~10 MB/s on the benchmark's manifests (its scanner, parser and event
//! queue; measured 2026-11-27: the same 11 MB of EndpointSlices took ~0.95 s into any target
//! type, 0.04 s with serde_json from JSON), which made reading a 10,000-service directory take
//! 40+ s in the test VM. This reader takes only a strict subset, where YAML has one obvious
//! meaning, and answers `None` for everything else, so the caller falls back to serde-saphyr,
//! which stays the authority on YAML (and words the errors):
//! - block mappings with plain keys (`[A-Za-z_][A-Za-z0-9._/-]*`, not a YAML 1.1 boolean or
//!   null word) and block sequences (`- item`, also `- key: value` and a sequence at its
//!   parent key's indentation), indented with spaces;
//! - scalars on one line: plain text; `true`/`false`; decimal integers without sign or
//!   leading zero noise; `null`/`~`/nothing; `"text"` without `\` or `"` inside; `'text'`
//!   without `'` inside; one-line flow collections (`[a, b]`, `{a: b, c: [d]}`) of plain
//!   scalars without `:` or quotes;
//! - whole-line comments and blank lines.
//!
//! Any other construct declines the whole document: tabs and control characters, `#` outside a
//! whole-line comment, other flow collections, anchors, aliases, tags, block scalars, multi-line
//! scalars, complex keys, duplicate keys, and plain scalars whose YAML type could be anything but
//! a string, `true`/`false` or a plain integer (floats, `0x`/`0o`, `+1`, `012`, `1_000`, `.inf`,
//! `yes`/`no`/`on`/`off`, `Null`, `1:30`...). On what it takes it gives exactly the
//! `serde_json::Value` serde-saphyr gives (a differential test in this module checks that,
//! also on many random mutations of real manifests).

use serde_json::{Map, Number, Value};

/// One content line: its indentation (spaces) and the text after it.
#[derive(Clone, Copy)]
struct Line<'a> {
    indent: usize,
    text: &'a str,
}

/// Reads one document (no `---` markers) into a value, or `None` when the document is outside
/// the subset this reader is sure of.
pub(super) fn read(doc: &str) -> Option<Value> {
    let mut lines = Vec::new();
    for raw in doc.split('\n') {
        if raw
            .chars()
            .any(|c| c.is_control() || matches!(c, '\u{feff}' | '\u{2028}' | '\u{2029}'))
        {
            return None;
        }
        let text = raw.trim_start_matches(' ');
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        if text.contains('#') {
            return None;
        }
        lines.push(Line {
            indent: raw.len() - text.len(),
            text: text.trim_end_matches(' '),
        });
    }
    let first = *lines.first()?;
    let mut reader = Reader { lines, pos: 0 };
    let value = reader.node(first.indent)?;
    (reader.pos == reader.lines.len()).then_some(value)
}

struct Reader<'a> {
    lines: Vec<Line<'a>>,
    pos: usize,
}

/// The text after a sequence dash (`-` alone or `- ` and more), if `text` is an item.
fn item(text: &str) -> Option<&str> {
    if text == "-" {
        Some("")
    } else {
        text.strip_prefix("- ")
    }
}

/// A `key: value` or `key:` line split at its first `:` that ends the text or precedes a
/// space; `None` when the line is not a mapping entry at all.
fn entry(text: &str) -> Option<(&str, &str)> {
    let colon = text
        .char_indices()
        .find(|&(i, c)| c == ':' && matches!(text.as_bytes().get(i + 1), None | Some(b' ')))?
        .0;
    Some((&text[..colon], text[colon + 1..].trim_start_matches(' ')))
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<Line<'a>> {
        self.lines.get(self.pos).copied()
    }

    /// The block node whose first line is the current one, at `indent`.
    fn node(&mut self, indent: usize) -> Option<Value> {
        let line = self.peek()?;
        if line.indent != indent {
            return None;
        }
        if item(line.text).is_some() {
            self.sequence(indent)
        } else if entry(line.text).is_some() {
            self.mapping(indent)
        } else {
            None
        }
    }

    /// What follows an entry's `key:` or an item's `-` with nothing after it on the line: a
    /// nested block (deeper, or a sequence at `indent` when `seq_here`), or null.
    fn nested(&mut self, indent: usize, seq_here: bool) -> Option<Value> {
        match self.peek() {
            Some(next) if next.indent > indent => self.node(next.indent),
            Some(next) if seq_here && next.indent == indent && item(next.text).is_some() => {
                self.sequence(indent)
            }
            _ => Some(Value::Null),
        }
    }

    /// A scalar written on the current line; nothing more indented may follow it.
    fn inline(&mut self, indent: usize, text: &str) -> Option<Value> {
        let value = scalar(text)?;
        match self.peek() {
            Some(next) if next.indent > indent => None,
            _ => Some(value),
        }
    }

    fn mapping(&mut self, indent: usize) -> Option<Value> {
        let mut map = Map::new();
        while let Some(line) = self.peek() {
            if line.indent < indent {
                break;
            }
            if line.indent > indent || item(line.text).is_some() {
                // Deeper than an entry, or a sequence item where an entry belongs.
                if line.indent == indent {
                    break;
                }
                return None;
            }
            let (key, rest) = entry(line.text)?;
            if !plain_key(key) || map.contains_key(key) {
                return None;
            }
            self.pos += 1;
            let value = if rest.is_empty() {
                self.nested(indent, true)?
            } else {
                self.inline(indent, rest)?
            };
            map.insert(key.to_string(), value);
        }
        Some(Value::Object(map))
    }

    fn sequence(&mut self, indent: usize) -> Option<Value> {
        let mut items = Vec::new();
        while let Some(line) = self.peek() {
            if line.indent != indent {
                if line.indent > indent {
                    return None;
                }
                break;
            }
            let Some(rest) = item(line.text) else { break };
            let trimmed = rest.trim_start_matches(' ');
            let inner = indent + 1 + (line.text.len() - 1 - trimmed.len());
            if trimmed.is_empty() {
                self.pos += 1;
                items.push(self.nested(indent, false)?);
            } else if item(trimmed).is_some() {
                // `- - x`: nested compact sequences are left to serde-saphyr.
                return None;
            } else if entry(trimmed).is_some() {
                // `- key: value`: a mapping whose first entry shares the dash's line, its
                // entries at the column of that key.
                self.lines[self.pos] = Line {
                    indent: inner,
                    text: trimmed,
                };
                items.push(self.mapping(inner)?);
            } else {
                self.pos += 1;
                items.push(self.inline(indent, trimmed)?);
            }
        }
        Some(Value::Array(items))
    }
}

/// A plain mapping key whose meaning is the same string in every YAML schema.
fn plain_key(key: &str) -> bool {
    let mut chars = key.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-'))
        && !ambiguous_word(key)
}

/// Words that some YAML schema reads as a boolean or null.
fn ambiguous_word(s: &str) -> bool {
    matches!(
        s.to_ascii_lowercase().as_str(),
        "true" | "false" | "yes" | "no" | "on" | "off" | "y" | "n" | "null" | "~"
    )
}

/// One scalar on one line, or `None` when its meaning is not certain here.
fn scalar(text: &str) -> Option<Value> {
    if text.starts_with(['[', '{']) {
        let mut flow = Flow { text, pos: 0 };
        let value = flow.collection()?;
        return (flow.pos == text.len()).then_some(value);
    }
    match text {
        "true" => return Some(Value::Bool(true)),
        "false" => return Some(Value::Bool(false)),
        "null" | "~" => return Some(Value::Null),
        _ => {}
    }
    if let Some(inner) = text.strip_prefix('"') {
        let inner = inner.strip_suffix('"')?;
        return (!inner.contains(['"', '\\'])).then(|| Value::String(inner.to_string()));
    }
    if let Some(inner) = text.strip_prefix('\'') {
        let inner = inner.strip_suffix('\'')?;
        return (!inner.contains('\'')).then(|| Value::String(inner.to_string()));
    }
    let first = text.chars().next()?;
    if "[]{},&*!|>%@`?:-'\"#.+".contains(first) || text.contains(": ") || text.ends_with(':') {
        return None;
    }
    if first.is_ascii_digit() {
        let digits = text.bytes().all(|b| b.is_ascii_digit());
        if digits && (text == "0" || (!text.starts_with('0') && text.len() <= 18)) {
            return text
                .parse::<u64>()
                .ok()
                .map(|n| Value::Number(Number::from(n)));
        }
        // Anything else number-like (octal, hex, 1_000, 1:30; floats below) is left to
        // serde-saphyr.
        if text.starts_with("0x")
            || text.starts_with("0o")
            || text.starts_with("0b")
            || text
                .bytes()
                .all(|b| b.is_ascii_digit() || matches!(b, b'_' | b':' | b'.'))
                && (text.contains('_') || text.contains(':'))
        {
            return None;
        }
    }
    if ambiguous_word(text) || text.parse::<f64>().is_ok() {
        return None;
    }
    Some(Value::String(text.to_string()))
}

/// A one-line flow collection (`[a, b]`, `{a: b, c: [d]}`) of plain scalars without `:`,
/// quotes or empty entries.
struct Flow<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Flow<'a> {
    fn skip_spaces(&mut self) {
        while self.text.as_bytes().get(self.pos) == Some(&b' ') {
            self.pos += 1;
        }
    }

    /// Consumes `byte` (after spaces) if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.skip_spaces();
        let hit = self.text.as_bytes().get(self.pos) == Some(&byte);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn collection(&mut self) -> Option<Value> {
        let (close, map) = if self.eat(b'[') {
            (b']', false)
        } else if self.eat(b'{') {
            (b'}', true)
        } else {
            return None;
        };
        let mut items = Vec::new();
        let mut entries = Map::new();
        if !self.eat(close) {
            loop {
                if map {
                    let key = self.plain()?;
                    if !plain_key(key) || entries.contains_key(key) {
                        return None;
                    }
                    // `key: value`, the colon right after the key and a space after it.
                    if self.text.as_bytes().get(self.pos..self.pos + 2) != Some(b": ") {
                        return None;
                    }
                    self.pos += 1;
                    let value = self.value()?;
                    entries.insert(key.to_string(), value);
                } else {
                    items.push(self.value()?);
                }
                if self.eat(close) {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
            }
        }
        self.skip_spaces();
        Some(if map {
            Value::Object(entries)
        } else {
            Value::Array(items)
        })
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_spaces();
        if self.text[self.pos..].starts_with(['[', '{']) {
            return self.collection();
        }
        // `plain` stops at `:`, so only quotes need declining here.
        let text = self.plain()?;
        if text.contains(['\'', '"']) {
            return None;
        }
        scalar(text)
    }

    /// The next plain scalar: up to a flow indicator or `:`, without the spaces around it;
    /// `None` when empty.
    fn plain(&mut self) -> Option<&'a str> {
        self.skip_spaces();
        let text: &'a str = self.text;
        let rest = &text[self.pos..];
        let len = rest
            .find([',', '[', ']', '{', '}', ':'])
            .unwrap_or(rest.len());
        self.pos += len;
        let text = rest[..len].trim_end_matches(' ');
        (!text.is_empty()).then_some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::Rng;
    use proptest::test_runner::{RngAlgorithm, TestRng};

    /// What serde-saphyr makes of `doc` as a generic value.
    fn saphyr(doc: &str) -> Option<Value> {
        serde_saphyr::from_str::<Value>(doc).ok()
    }

    /// When this reader takes `doc`, serde-saphyr must give the same value.
    fn agrees(doc: &str) -> bool {
        match read(doc) {
            Some(fast) => {
                assert_eq!(
                    Some(&fast),
                    saphyr(doc).as_ref(),
                    "the fast reader and serde-saphyr disagree on:\n{doc}"
                );
                true
            }
            None => false,
        }
    }

    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: svc-1-abcde\n  namespace: bench\n  labels:\n    kubernetes.io/service-name: svc-1\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\naddressType: IPv4\nports:\n- name: http\n  port: 8080\n  protocol: TCP\nendpoints:\n- addresses:\n  - 10.244.0.1\n  conditions:\n    ready: true\n    serving: true\n    terminating: false\n  nodeName: node-0\n  targetRef:\n    kind: Pod\n    name: svc-1-pod-0\n    namespace: bench\n- addresses:\n  - fd00::2\n  conditions:\n    ready: false\n  zone: \"zone-a\"\n";

    const SERVICE: &str = "# a Service\napiVersion: v1\nkind: Service\nmetadata:\n    name: web\n    annotations: {}\n    labels:\n        app.kubernetes.io/name: 'web'\n        version: \"1\"\nspec:\n    type: LoadBalancer\n    clusterIP: None\n    clusterIPs:\n        - None\n    externalIPs: []\n    selector:\n    ports:\n        -   name: http\n            port: 80\n            targetPort: http\n\n        -   port: 443\n            targetPort: 8443\n            nodePort: 30443\n    sessionAffinityConfig:\n        clientIP:\n            timeoutSeconds: 0\nstatus:\n  loadBalancer:\n    ingress:\n    -\n      ip: 192.0.2.1\n";

    #[test]
    fn kubernetes_manifests_read_like_serde_saphyr() {
        assert!(agrees(SLICE));
        assert!(agrees(SERVICE));
        let v = read(SERVICE).unwrap_or_default();
        assert_eq!(v["spec"]["ports"][1]["nodePort"], 30443);
        assert_eq!(v["spec"]["selector"], Value::Null);
        assert_eq!(v["metadata"]["labels"]["version"], "1");
        assert_eq!(v["status"]["loadBalancer"]["ingress"][0]["ip"], "192.0.2.1");
    }

    /// The documents of the repository's example and deployment manifests.
    fn manifests() -> Vec<String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut docs = Vec::new();
        for dir in ["examples", "deploy"] {
            let mut paths: Vec<_> = std::fs::read_dir(root.join(dir))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            paths.sort();
            for p in paths {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                docs.extend(text.split("\n---\n").map(str::to_string));
            }
        }
        docs
    }

    #[test]
    fn the_repositorys_manifests_are_taken_and_agree() {
        let docs = manifests();
        let taken = docs.iter().filter(|d| agrees(d)).count();
        assert!(taken * 2 > docs.len(), "taken {taken} of {}", docs.len());
    }

    #[test]
    fn uncertain_constructs_decline() {
        for doc in [
            "a: 1.5\n",
            "a: 0x10\n",
            "a: 012\n",
            "a: +1\n",
            "a: 1_000\n",
            "a: 1:30\n",
            "a: .inf\n",
            "a: nan\n",
            "a: yes\n",
            "a: True\n",
            "a: Null\n",
            "a: -1\n",
            "a: 123456789012345678901\n",
            "a: x # comment\n",
            "a: \"x\\ty\"\n",
            "a: 'it''s'\n",
            "a: \"open\n",
            "a: |\n  text\n",
            "a: >\n  text\n",
            "a: &x 1\nb: *x\n",
            "a: !!str 1\n",
            "a: [1,]\n",
            "a: [1, , 2]\n",
            "a: [b: c]\n",
            "a: {b:1}\n",
            "a: {b: }\n",
            "a: {b}\n",
            "a: [\"x\"]\n",
            "a: ['x']\n",
            "a: [fd00::1]\n",
            "a: [1] x\n",
            "a: [1\n",
            "a: [1]]\n",
            "a: {b: 1, b: 2}\n",
            "a: b: c\n",
            "a: plain\n  continued\n",
            "a:\n- - x\n",
            "a: 1\na: 2\n",
            "? a\n: 1\n",
            "\"a\": 1\n",
            "1: a\n",
            "on: 1\n",
            "<<: {}\n",
            "a:\tb\n",
            "a: b\r\n",
            "\u{feff}a: b\n",
            "a\n",
            "- a\n  b: c\n",
            "a:\n    b: 1\n  c: 2\n",
        ] {
            assert!(read(doc).is_none(), "taken: {doc:?}");
        }
    }

    #[test]
    fn structure_matches_serde_saphyr() {
        for doc in [
            "a:\n- 1\n- two\nb: c\n",
            "a:\n  - 1\n  -\n    b: c\n  - d: e\n    f: g\n",
            "- a\n- b: c\n  d:\n  - e\n",
            "a:\nb: ~\nc: null\nd: ''\ne: \"\"\n",
            "  a: 1\n  b:\n    c: 2\n",
            "a: http://x/y?z=1\nb: 10.96.0.1\nc: fd00::1\nd: 2024-01-01T00:00:00Z\n",
            "a: 0\nb: 18446744073\nc: x-1\nd: None\n",
            "a: [1, two, 10.0.0.1]\nb: {c: true, d: [{e: f}, []], g: {}}\nc: [ ]\nd: { }\n",
            "- addresses: [10.244.1.2]\n  conditions: {ready: true, serving: false}\n",
            "a:    spaced   \n\n# comment\n  # indented comment\nb: x-\n",
        ] {
            assert!(agrees(doc), "declined: {doc:?}");
        }
    }

    /// `0..n` from proptest's deterministic generator (failures reproduce).
    fn below(rng: &mut TestRng, n: usize) -> usize {
        (rng.next_u64() % n as u64) as usize
    }

    /// Random edits of real manifests (characters inserted, deleted or replaced by YAML's
    /// special characters, lines re-indented or duplicated): whatever the reader takes, it
    /// must read exactly as serde-saphyr does.
    #[test]
    fn random_mutations_never_disagree_with_serde_saphyr() {
        const ALPHABET: &[&str] = &[
            " ", "  ", "-", "- ", ":", ": ", "#", "'", "\"", "\\", "{", "}", "[", "]", ",", "&",
            "*", "!", "|", ">", "?", "%", "@", "~", ".", "0", "1", "07", "0x", "e", "_", "\n",
            "\n  ", "\n- ", "true", "no", "null", "1.5", "a", "Z",
        ];
        let mut bases = vec![SLICE.to_string(), SERVICE.to_string()];
        bases.extend(manifests());
        let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
        let mut taken = 0;
        let runs = 6000;
        for i in 0..runs {
            let mut doc = bases[i % bases.len()].clone();
            for _ in 0..1 + below(&mut rng, 3) {
                let mut at = below(&mut rng, doc.len() + 1);
                while !doc.is_char_boundary(at) {
                    at -= 1;
                }
                match below(&mut rng, 4) {
                    0 => doc.insert_str(at, ALPHABET[below(&mut rng, ALPHABET.len())]),
                    1 => {
                        let end = (at + 1 + below(&mut rng, 4)).min(doc.len());
                        if doc.is_char_boundary(end) {
                            doc.replace_range(at..end, "");
                        }
                    }
                    2 => {
                        let end = (at + 1).min(doc.len());
                        if doc.is_char_boundary(end) {
                            doc.replace_range(at..end, ALPHABET[below(&mut rng, ALPHABET.len())]);
                        }
                    }
                    _ => {
                        let lines: Vec<&str> = doc.lines().collect();
                        let n = below(&mut rng, lines.len());
                        let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
                        if below(&mut rng, 2) == 0 {
                            out.insert(n, lines[n].to_string());
                        } else {
                            out[n] =
                                format!("{}{}", " ".repeat(below(&mut rng, 5)), lines[n].trim());
                        }
                        doc = out.join("\n");
                    }
                }
            }
            taken += usize::from(agrees(&doc));
        }
        // Most mutations leave a readable document: the comparison must have had work.
        assert!(taken > runs / 8, "taken {taken} of {runs}");
    }
}
