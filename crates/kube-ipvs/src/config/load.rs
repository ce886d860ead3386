//! Loading: defaults, the `--config` file and the flags merged into one table of values with
//! their origins (`Ctx`), unknown and ignored fields reported as warnings.

use super::*;

/// A validated config plus the warnings (unknown / ignored fields) to log once.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The configuration.
    pub config: Config,
    /// One line per unknown or ignored field.
    pub warnings: Vec<String>,
}

/// Where a value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    Default,
    File,
    Flag(&'static str),
}

pub(super) fn key(st: &Setting) -> &'static str {
    st.field.or(st.flag).unwrap_or_default()
}

/// The host name, from the kernel.
pub fn system_hostname() -> Result<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(Error::HostnameRead)
}

/// Loads the config for a parsed command line: reads `--config` if given, uses the kernel's
/// host name unless overridden.
pub fn load(args: &Args) -> Result<Loaded> {
    let file = match args.flag("config").filter(|p| !p.is_empty()) {
        Some(p) => {
            let path = PathBuf::from(p);
            let text = std::fs::read_to_string(&path).map_err(|source| Error::ConfigRead {
                path: path.clone(),
                source,
            })?;
            Some((path, text))
        }
        None => None,
    };
    from_sources(
        file.as_ref().map(|(p, t)| (p.as_path(), t.as_str())),
        &args.flags,
        system_hostname,
    )
}

/// Builds the config from an optional file `(path, text)`, the command-line flags, and a host
/// name lookup (called only if no `hostnameOverride` is given; its error becomes
/// [`Error::NodeName`]).
pub fn from_sources(
    file: Option<(&Path, &str)>,
    flags: &[(&'static Setting, String)],
    hostname: impl FnOnce() -> Result<String>,
) -> Result<Loaded> {
    let mut values: BTreeMap<&'static str, (Value, Origin)> = BTreeMap::new();
    let mut warnings = Vec::new();
    let mut errors = Vec::new();
    for st in SETTINGS {
        let v = settings::parse_text(st.ty, st.default).unwrap_or(Value::Null);
        values.insert(key(st), (v, Origin::Default));
    }

    if let Some((path, text)) = file {
        let doc: Value = serde_saphyr::from_str(text).map_err(|e| Error::ConfigParse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let Value::Object(map) = doc else {
            return Err(Error::ConfigParse {
                path: path.to_path_buf(),
                message: format!("expected a {KIND} mapping"),
            });
        };
        let api = map
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = map.get("kind").and_then(Value::as_str).unwrap_or_default();
        if api != API_VERSION || kind != KIND {
            return Err(Error::ConfigParse {
                path: path.to_path_buf(),
                message: format!(
                    "expected apiVersion {API_VERSION:?} and kind {KIND:?}, got {api:?} and {kind:?}"
                ),
            });
        }
        walk_file("", &map, &mut values, &mut warnings);
    }

    for (st, text) in flags {
        let Some(flag) = st.flag else { continue };
        match settings::parse_text(st.ty, text) {
            Ok(v) => {
                if let Support::Ignored(why) = st.support {
                    if !settings::is_zero(&v) {
                        warnings.push(format!("--{flag} is ignored: {why}"));
                    }
                }
                values.insert(key(st), (v, Origin::Flag(flag)));
            }
            Err(e) => errors.push(FieldError {
                field: format!("--{flag}"),
                message: e.to_string(),
            }),
        }
    }

    let mut cx = Ctx { values, errors };
    let config = build(&mut cx, hostname);
    if !cx.errors.is_empty() {
        return Err(Error::InvalidConfig(cx.errors));
    }
    let config = config?;
    Ok(Loaded { config, warnings })
}

pub(super) fn walk_file(
    prefix: &str,
    map: &serde_json::Map<String, Value>,
    values: &mut BTreeMap<&'static str, (Value, Origin)>,
    warnings: &mut Vec<String>,
) {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if let Some(st) = settings::by_field(&path) {
            if v.is_null() || (st.zero_is_unset && settings::is_zero(v)) {
                continue;
            }
            if let Support::Ignored(why) = st.support {
                if !settings::is_zero(v) {
                    warnings.push(format!("field {path} is ignored: {why}"));
                }
            }
            values.insert(key(st), (v.clone(), Origin::File));
        } else if settings::is_parent(&path) {
            match v {
                Value::Object(m) => walk_file(&path, m, values, warnings),
                Value::Null => {}
                _ => warnings.push(format!("field {path} should be a mapping; ignored")),
            }
        } else {
            warnings.push(format!("unknown field {path} (ignored)"));
        }
    }
}

pub(super) struct Ctx {
    pub(super) values: BTreeMap<&'static str, (Value, Origin)>,
    pub(super) errors: Vec<FieldError>,
}

impl Ctx {
    pub(super) fn name(&self, key: &str) -> String {
        match self.values.get(key) {
            Some((_, Origin::Flag(f))) => format!("--{f}"),
            Some((_, Origin::Default)) => format!("{key} (default)"),
            _ => key.to_string(),
        }
    }

    pub(super) fn has_error(&self, key: &str) -> bool {
        let name = self.name(key);
        self.errors.iter().any(|e| e.field == name)
    }

    pub(super) fn origin(&self, key: &str) -> Origin {
        self.values
            .get(key)
            .map(|(_, o)| *o)
            .unwrap_or(Origin::Default)
    }

    pub(super) fn err(&mut self, key: &str, message: impl Into<String>) {
        self.errors.push(FieldError {
            field: self.name(key),
            message: message.into(),
        });
    }

    pub(super) fn value(&self, key: &str) -> Value {
        self.values
            .get(key)
            .map(|(v, _)| v.clone())
            .unwrap_or(Value::Null)
    }

    pub(super) fn boolean(&mut self, key: &str) -> bool {
        match self.value(key) {
            Value::Bool(b) => b,
            Value::Null => false,
            other => {
                self.err(key, format!("expected true or false, got {other}"));
                false
            }
        }
    }

    pub(super) fn int(&mut self, key: &str, min: i64, max: i64) -> i64 {
        match self.value(key) {
            Value::Number(n) => match n.as_i64() {
                Some(i) if (min..=max).contains(&i) => i,
                Some(i) => {
                    self.err(key, format!("{i} is out of range {min}..={max}"));
                    min.max(0).min(max)
                }
                None => {
                    self.err(key, format!("expected an integer, got {n}"));
                    min.max(0).min(max)
                }
            },
            Value::Null => min.max(0).min(max),
            other => {
                self.err(key, format!("expected an integer, got {other}"));
                min.max(0).min(max)
            }
        }
    }

    pub(super) fn float(&mut self, key: &str) -> f64 {
        match self.value(key) {
            Value::Number(n) => match n.as_f64() {
                Some(f) if f >= 0.0 => f,
                _ => {
                    self.err(key, format!("must be a number >= 0, got {n}"));
                    0.0
                }
            },
            Value::Null => 0.0,
            other => {
                self.err(key, format!("expected a number, got {other}"));
                0.0
            }
        }
    }

    pub(super) fn string(&mut self, key: &str) -> String {
        match self.value(key) {
            Value::String(s) => s,
            Value::Null => String::new(),
            other => {
                self.err(key, format!("expected a string, got {other}"));
                String::new()
            }
        }
    }

    pub(super) fn duration(&mut self, key: &str) -> Duration {
        match self.value(key) {
            Value::String(s) => match crate::duration::parse(&s) {
                Ok(d) => d,
                Err(e) => {
                    self.err(key, e.to_string());
                    Duration::ZERO
                }
            },
            Value::Null => Duration::ZERO,
            other => {
                self.err(
                    key,
                    format!("expected a duration string like \"30s\", got {other}"),
                );
                Duration::ZERO
            }
        }
    }

    pub(super) fn list(&mut self, key: &str) -> Vec<String> {
        match self.value(key) {
            Value::Array(a) => {
                let mut out = Vec::new();
                for (i, v) in a.into_iter().enumerate() {
                    match v {
                        Value::String(s) => out.push(s),
                        other => self.err(
                            &format!("{key}[{i}]"),
                            format!("expected a string, got {other}"),
                        ),
                    }
                }
                out
            }
            Value::Null => Vec::new(),
            other => {
                self.err(key, format!("expected a list of strings, got {other}"));
                Vec::new()
            }
        }
    }

    pub(super) fn cidr(&mut self, key: &str, index: Option<usize>, s: &str) -> Option<IpNet> {
        match s.trim().parse::<IpNet>() {
            Ok(n) => Some(n.trunc()),
            Err(_) => {
                let field = match index {
                    Some(i) => format!("{}[{i}]", self.name(key)),
                    None => self.name(key),
                };
                self.errors.push(FieldError {
                    field,
                    message: format!("invalid CIDR {s:?}"),
                });
                None
            }
        }
    }

    pub(super) fn bind(&mut self, key: &str, default_port: u16, default_ip: IpAddr) -> SocketAddr {
        let s = self.string(key);
        if self.origin(key) == Origin::Default {
            return SocketAddr::new(default_ip, default_port);
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return a;
        }
        let bare = s.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return SocketAddr::new(ip, default_port);
        }
        self.err(
            key,
            format!("invalid address {s:?}: expected IP:port or IP"),
        );
        SocketAddr::new(default_ip, default_port)
    }
}
