//! Label and field selectors, parsed and matched the way the Kubernetes API server does.

use serde_json::Value;
use std::collections::BTreeSet;

/// Why a label or field selector could not be parsed (the message of the 400 the server
/// answers with).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// A `)` closes no `(`.
    #[error("unbalanced ')' in selector {0:?}")]
    UnbalancedClose(String),
    /// A `(` is never closed.
    #[error("unbalanced '(' in selector {0:?}")]
    UnbalancedOpen(String),
    /// A set-based requirement's values are not in parentheses.
    #[error("expected '(values)' in requirement {0:?}")]
    ExpectedValues(String),
    /// A value of a set-based requirement is not a valid label value.
    #[error("invalid label value {value:?} in {requirement:?}")]
    InvalidSetValue {
        /// The value.
        value: String,
        /// The whole requirement.
        requirement: String,
    },
    /// Two commas with nothing between them.
    #[error("empty requirement in label selector")]
    EmptyRequirement,
    /// A key is not a valid label key.
    #[error("invalid label key {0:?}")]
    InvalidKey(String),
    /// A value is not a valid label value.
    #[error("invalid label value {0:?}")]
    InvalidValue(String),
    /// A requirement is none of the known forms.
    #[error("unable to parse requirement {0:?}")]
    Unparsable(String),
    /// A field selector requirement has no `=`, `==` or `!=`.
    #[error("invalid field selector requirement {0:?}")]
    InvalidFieldRequirement(String),
    /// A field selector names a field other than `metadata.name` and `metadata.namespace`.
    #[error(
        "field label not supported: {0} (the fake server knows metadata.name and metadata.namespace)"
    )]
    UnsupportedField(String),
}

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    /// `key` — the label exists.
    Exists(String),
    /// `!key` — the label does not exist.
    NotExists(String),
    /// `key=value` / `key==value`.
    Equals(String, String),
    /// `key!=value` (also true when the label is absent).
    NotEquals(String, String),
    /// `key in (a,b)`.
    In(String, BTreeSet<String>),
    /// `key notin (a,b)` (also true when the label is absent).
    NotIn(String, BTreeSet<String>),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

/// Split on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, SelectorError> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| SelectorError::UnbalancedClose(s.into()))?;
            }
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(SelectorError::UnbalancedOpen(s.into()));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_set(rest: &str, whole: &str) -> Result<BTreeSet<String>, SelectorError> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| SelectorError::ExpectedValues(whole.into()))?;
    let mut set = BTreeSet::new();
    for v in inner.split(',') {
        let v = v.trim();
        if !valid_value(v) {
            return Err(SelectorError::InvalidSetValue {
                value: v.into(),
                requirement: whole.into(),
            });
        }
        set.insert(v.to_string());
    }
    Ok(set)
}

fn parse_requirement(part: &str) -> Result<Requirement, SelectorError> {
    let p = part.trim();
    if p.is_empty() {
        return Err(SelectorError::EmptyRequirement);
    }
    if let Some(key) = p.strip_prefix('!') {
        let key = key.trim();
        if !valid_key(key) {
            return Err(SelectorError::InvalidKey(key.into()));
        }
        return Ok(Requirement::NotExists(key.into()));
    }
    let check = |k: &str, v: &str| -> Result<(String, String), SelectorError> {
        let (k, v) = (k.trim(), v.trim());
        if !valid_key(k) {
            return Err(SelectorError::InvalidKey(k.into()));
        }
        if !valid_value(v) {
            return Err(SelectorError::InvalidValue(v.into()));
        }
        Ok((k.into(), v.into()))
    };
    if let Some((k, v)) = p.split_once("!=") {
        let (k, v) = check(k, v)?;
        return Ok(Requirement::NotEquals(k, v));
    }
    if let Some((k, v)) = p.split_once("==") {
        let (k, v) = check(k, v)?;
        return Ok(Requirement::Equals(k, v));
    }
    if let Some((k, v)) = p.split_once('=') {
        let (k, v) = check(k, v)?;
        return Ok(Requirement::Equals(k, v));
    }
    // set-based: "key in (..)" / "key notin (..)"
    let mut words = p.splitn(2, char::is_whitespace);
    let key = words.next().unwrap_or_default().trim();
    let rest = words.next().unwrap_or_default().trim_start();
    if rest.is_empty() {
        if !valid_key(key) {
            return Err(SelectorError::InvalidKey(key.into()));
        }
        return Ok(Requirement::Exists(key.into()));
    }
    if !valid_key(key) {
        return Err(SelectorError::InvalidKey(key.into()));
    }
    if let Some(r) = rest.strip_prefix("notin") {
        return Ok(Requirement::NotIn(key.into(), parse_set(r, p)?));
    }
    if let Some(r) = rest.strip_prefix("in") {
        return Ok(Requirement::In(key.into(), parse_set(r, p)?));
    }
    Err(SelectorError::Unparsable(p.into()))
}

impl LabelSelector {
    /// Parse a selector such as `!a,b=c,d in (x,y)`.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        if s.trim().is_empty() {
            return Ok(Self::default());
        }
        split_top_level(s)?
            .into_iter()
            .map(parse_requirement)
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }

    /// True when the selector selects everything (no requirement).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object (JSON) satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, set) => get(k).is_some_and(|x| set.contains(x)),
            Requirement::NotIn(k, set) => get(k).is_none_or(|x| !set.contains(x)),
        })
    }
}

/// A parsed field selector (only `metadata.name` and `metadata.namespace`, like most kinds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parse `metadata.name=x,metadata.namespace!=y`.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        if s.trim().is_empty() {
            return Ok(Self::default());
        }
        let mut reqs = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let (field, eq, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, true, v)
            } else {
                return Err(SelectorError::InvalidFieldRequirement(part.into()));
            };
            let field = field.trim();
            if field != "metadata.name" && field != "metadata.namespace" {
                return Err(SelectorError::UnsupportedField(field.into()));
            }
            reqs.push((field.to_string(), eq, value.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    /// True when the selector selects everything (no requirement).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object (JSON) satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, value)| {
            let ptr = if field == "metadata.name" {
                "/metadata/name"
            } else {
                "/metadata/namespace"
            };
            let actual = obj.pointer(ptr).and_then(Value::as_str).unwrap_or("");
            (actual == value) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn proxy_selector() {
        let s = LabelSelector::parse(
            "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless",
        )
        .unwrap();
        assert!(s.matches(&obj(json!({"app": "x"}))));
        assert!(s.matches(&json!({"metadata": {"name": "a"}})));
        assert!(!s.matches(&obj(json!({"service.kubernetes.io/headless": ""}))));
        assert!(!s.matches(&obj(
            json!({"service.kubernetes.io/service-proxy-name": "other"})
        )));
    }

    #[test]
    fn set_and_equality() {
        let s = LabelSelector::parse("tier in (a, b),env notin (prod),x!=1,y==2,z").unwrap();
        assert!(s.matches(&obj(json!({"tier": "a", "y": "2", "z": ""}))));
        assert!(!s.matches(&obj(json!({"tier": "c", "y": "2", "z": ""}))));
        assert!(!s.matches(&obj(json!({"tier": "b", "env": "prod", "y": "2", "z": ""}))));
        assert!(!s.matches(&obj(json!({"tier": "b", "x": "1", "y": "2", "z": ""}))));
        assert!(!s.matches(&obj(json!({"tier": "b", "y": "2"}))));
        assert!(LabelSelector::parse("a in (b").is_err());
        assert!(LabelSelector::parse("a b").is_err());
        assert!(LabelSelector::parse("a=b,,c").is_err());
    }

    #[test]
    fn field_selector() {
        let f = FieldSelector::parse("metadata.name=a").unwrap();
        assert!(f.matches(&obj(json!({}))));
        let f = FieldSelector::parse("metadata.name!=a,metadata.namespace=ns").unwrap();
        assert!(!f.matches(&obj(json!({}))));
        assert!(FieldSelector::parse("spec.clusterIP=1").is_err());
    }
}
