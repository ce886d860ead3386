//! Go `time.Duration` text ("30s", "1m0s", "2h45m", "1.5h", "300ms") parsing and formatting.

use std::time::Duration;

use crate::error::ValueError;

/// Parses a Go duration string. Negative durations are returned as `Err`, so the caller can
/// name the field; "0" alone is allowed like in Go.
pub fn parse(s: &str) -> Result<Duration, ValueError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(ValueError::Duration(s.into()));
    }
    let (neg, mut rest) = match t.as_bytes()[0] {
        b'-' => (true, &t[1..]),
        b'+' => (false, &t[1..]),
        _ => (false, t),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(ValueError::Duration(s.into()));
    }
    let mut total_ns: f64 = 0.0;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let num = &rest[..num_len];
        if num.is_empty() || num == "." || num.matches('.').count() > 1 {
            return Err(ValueError::Duration(s.into()));
        }
        let value: f64 = num.parse().map_err(|_| ValueError::Duration(s.into()))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => return Err(ValueError::DurationMissingUnit(s.into())),
            u => {
                return Err(ValueError::DurationUnknownUnit {
                    text: s.into(),
                    unit: u.into(),
                })
            }
        };
        total_ns += value * scale;
    }
    if !total_ns.is_finite() || total_ns > u64::MAX as f64 {
        return Err(ValueError::DurationOutOfRange(s.into()));
    }
    if neg && total_ns > 0.0 {
        return Err(ValueError::NegativeDuration(s.into()));
    }
    Ok(Duration::from_nanos(total_ns.round() as u64))
}

/// Formats like Go's `Duration.String()` for the values configs use: "0s", "300ms", "30s",
/// "15m0s", "24h0m0s", "1m30.5s".
pub fn format(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    let total_ns = d.as_nanos();
    if total_ns < 1_000_000_000 {
        return if total_ns % 1_000_000 == 0 {
            format!("{}ms", total_ns / 1_000_000)
        } else if total_ns % 1_000 == 0 {
            format!("{}µs", total_ns / 1_000)
        } else {
            format!("{total_ns}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    let frac = d.subsec_nanos();
    let sec = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{frac:09}");
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    if h > 0 {
        format!("{h}h{m}m{sec}")
    } else if m > 0 {
        format!("{m}m{sec}")
    } else {
        sec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        let cases = [
            ("0", 0),
            ("0s", 0),
            ("30s", 30_000),
            ("1m0s", 60_000),
            ("2h45m", 9_900_000),
            ("1.5h", 5_400_000),
            ("300ms", 300),
            ("1m30.5s", 90_500),
            ("+5s", 5_000),
            ("-0s", 0),
        ];
        for (s, ms) in cases {
            assert_eq!(parse(s), Ok(Duration::from_millis(ms)), "{s}");
        }
        assert_eq!(parse("1500us"), Ok(Duration::from_micros(1500)));
        assert_eq!(parse("7ns"), Ok(Duration::from_nanos(7)));
    }

    #[test]
    fn rejects_bad_durations() {
        for s in ["", "3x", "30", "s", "1..5s", "-5s", "5 s", "1h-5m", "abc"] {
            assert!(parse(s).is_err(), "{s:?} should fail");
        }
        assert!(parse("-5s").unwrap_err().to_string().contains("negative"));
        assert!(parse("3x")
            .unwrap_err()
            .to_string()
            .contains("unknown unit \"x\""));
    }

    #[test]
    fn formats_like_go() {
        let cases = [
            (0, "0s"),
            (300, "300ms"),
            (30_000, "30s"),
            (900_000, "15m0s"),
            (86_400_000, "24h0m0s"),
            (3_600_000, "1h0m0s"),
            (90_500, "1m30.5s"),
        ];
        for (ms, s) in cases {
            assert_eq!(format(Duration::from_millis(ms)), s);
            assert_eq!(parse(s), Ok(Duration::from_millis(ms)), "round trip {s}");
        }
    }
}
