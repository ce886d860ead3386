//! The peers plots: grouped bars (one group per N x M, one bar per proxy) on a log scale,
//! hand-written SVG like the other benchmark plots. A proxy that did not converge gets a pale
//! bar up to its cap, marked `>`.

use super::{group, PROXIES};
use serde_json::Value;

const W: f64 = 820.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 5] = ["#1f77b4", "#6baed6", "#d62728", "#ff7f0e", "#9467bd"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// (file name, title, unit, row key).
const PLOTS: [(&str, &str, &str, &str); 4] = [
    (
        "peers-converge.svg",
        "Start to every Service in the kernel",
        "s",
        "converge_s",
    ),
    (
        "peers-cpu.svg",
        "CPU to converge (user + system)",
        "s",
        "cpu_s",
    ),
    ("peers-rss.svg", "Steady RSS", "MiB", "rss_steady_mib"),
    (
        "peers-change.svg",
        "One endpoint change, API write to kernel, p99",
        "ms",
        "change_p99_ms",
    ),
];

/// Every plot of `rows`: (file name, SVG).
pub fn plots(rows: &[Value]) -> Vec<(String, String)> {
    let date = rows
        .iter()
        .filter_map(|r| r["date"].as_str())
        .max()
        .unwrap_or("?");
    PLOTS
        .iter()
        .map(|(file, title, unit, key)| {
            let sub = format!(
                "cargo xtask bench peers; QEMU TCG, 2 vCPUs; {date}; log scale; pale bar: not converged by the cap"
            );
            (file.to_string(), bars(title, &sub, unit, rows, key))
        })
        .collect()
}

/// The value of `key` in `r` and whether it is a lower bound (not converged: the cap).
fn value(r: &Value, key: &str) -> Option<(f64, bool)> {
    if r.get("skipped").is_some() {
        // Not run at this scale: no bar.
        return None;
    }
    if r["converged"] != true {
        if key == "converge_s" {
            return r["cap_s"].as_f64().map(|c| (c, true));
        }
        if key != "cpu_s" {
            return None;
        }
        return r[key].as_f64().map(|v| (v, true));
    }
    r[key]
        .as_f64()
        .filter(|v| v.is_finite())
        .map(|v| (v, false))
}

/// A grouped bar chart of `key` over the scales of `rows`.
pub fn bars(title: &str, sub: &str, unit: &str, rows: &[Value], key: &str) -> String {
    let mut scales: Vec<(u64, u64)> = rows
        .iter()
        .filter_map(|r| Some((r["services"].as_u64()?, r["endpoints"].as_u64()?)))
        .collect();
    scales.dedup();
    let vals: Vec<f64> = rows
        .iter()
        .filter_map(|r| value(r, key))
        .map(|(v, _)| v)
        .filter(|v| *v > 0.0)
        .collect();
    let lo = vals
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .log10()
        .floor();
    let hi = vals
        .iter()
        .copied()
        .fold(0.0, f64::max)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let py = |v: f64| TOP + ph - (v.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * ph;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"18\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
         <text x=\"{LEFT}\" y=\"34\" font-size=\"11\" fill=\"#555\">{}</text>\n",
        esc(title),
        esc(sub)
    );
    let mut d = lo;
    while d <= hi {
        let y = py(10f64.powf(d));
        let label = if d >= 0.0 {
            format!("{}", 10f64.powf(d))
        } else {
            format!("{:.*}", (-d) as usize, 10f64.powf(d))
        };
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{} {unit}</text>\n",
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            label
        ));
        d += 1.0;
    }
    let gw = pw / scales.len().max(1) as f64;
    let bw = (gw - 20.0) / PROXIES.len() as f64;
    for (g, (n, m)) in scales.iter().enumerate() {
        let gx = LEFT + g as f64 * gw + 10.0;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} x {m}</text>\n",
            gx + (gw - 20.0) / 2.0,
            TOP + ph + 18.0,
            group(*n)
        ));
        for (k, p) in PROXIES.iter().enumerate() {
            let Some(r) = rows.iter().find(|r| {
                r["proxy"] == *p
                    && r["services"].as_u64() == Some(*n)
                    && r["endpoints"].as_u64() == Some(*m)
            }) else {
                continue;
            };
            let Some((v, lower)) = value(r, key) else {
                continue;
            };
            let x = gx + k as f64 * bw;
            let y = py(v);
            let opacity = if lower { "0.3" } else { "1" };
            s.push_str(&format!(
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" fill-opacity=\"{opacity}\"/>\n",
                (bw - 2.0).max(1.0),
                (TOP + ph - y).max(0.0),
                COLOURS[k]
            ));
            if lower {
                s.push_str(&format!(
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">&gt;</text>\n",
                    x + bw / 2.0,
                    y - 3.0
                ));
            }
        }
    }
    s.push_str(&format!(
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#333\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">Services x endpoints each</text>\n",
        LEFT + pw / 2.0,
        H - 12.0
    ));
    for (k, p) in PROXIES.iter().enumerate() {
        let ly = TOP + 10.0 + k as f64 * 20.0;
        let lx = LEFT + pw + 14.0;
        s.push_str(&format!(
            "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"14\" height=\"10\" fill=\"{}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{p}</text>\n",
            ly - 6.0,
            COLOURS[k],
            lx + 20.0,
            ly + 4.0
        ));
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_bar_per_proxy_and_scale_and_pale_bars_for_caps() {
        let rows = vec![
            json!({"proxy": "kube-ipvs", "services": 1000, "endpoints": 10, "converged": true, "converge_s": 2.5}),
            json!({"proxy": "upstream-ipvs", "services": 1000, "endpoints": 10, "converged": true, "converge_s": 130.0}),
            json!({"proxy": "kube-ipvs", "services": 5000, "endpoints": 10, "converged": true, "converge_s": 9.0}),
            json!({"proxy": "upstream-nftables", "services": 5000, "endpoints": 10, "converged": false, "cap_s": 1200}),
        ];
        let svg = bars("t", "s", "s", &rows, "converge_s");
        assert_eq!(svg.matches("<rect x=").count(), 4 + 1 + 5, "{svg}");
        assert_eq!(svg.matches("fill-opacity=\"0.3\"").count(), 1);
        assert!(svg.contains("5,000 x 10") && svg.contains("1,000 x 10"));
        assert!(svg.ends_with("</svg>\n"));
        assert_eq!(plots(&rows).len(), 4);
    }
}
