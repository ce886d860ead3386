//! A tiny hand-written SVG line plot: time (log scale) vs number of services, one line per
//! measured series, rendered from the bench JSON runs.

use serde_json::Value;

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 50.0;

/// (label, colour, dashed, JSON pointer into a run).
const SERIES: [(&str, &str, bool, &str); 7] = [
    ("ipvsadm --restore", "#d62728", true, "/ipvsadm_restore_s"),
    ("P1 full program (total)", "#1f77b4", false, "/p1/total_s"),
    ("P1 IPVS part", "#17becf", false, "/p1/ipvs_s"),
    ("ipvsadm -Sn", "#ff7f0e", true, "/p4/ipvsadm_save_s"),
    ("P4 drift check (total)", "#2ca02c", false, "/p4/total_s"),
    ("P2 add service", "#9467bd", false, "/p2/add-service/wall_s"),
    ("P2 one endpoint", "#8c564b", false, "/p2/endpoint/wall_s"),
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the plot of `runs` (each with `services` and the series' fields).
pub fn scaling_plot(runs: &[Value], reals: usize, kernel: &str, date: &str) -> String {
    let xs: Vec<f64> = runs.iter().filter_map(|r| r["services"].as_f64()).collect();
    let xmax = xs.iter().copied().fold(1.0, f64::max);
    let vals: Vec<f64> = SERIES
        .iter()
        .flat_map(|s| runs.iter().filter_map(|r| r.pointer(s.3)?.as_f64()))
        .filter(|v| *v > 0.0 && v.is_finite())
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
        .fold(f64::NEG_INFINITY, f64::max)
        .log10()
        .ceil();
    let (lo, hi) = if lo.is_finite() && hi.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (-3.0, 2.0)
    };
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |x: f64| LEFT + x / xmax * pw;
    let py = |v: f64| TOP + (hi - v.log10()) / (hi - lo) * ph;

    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"18\" font-size=\"14\" font-weight=\"bold\">kube-ipvs: time vs services ({reals} reals each)</text>\n\
         <text x=\"{LEFT}\" y=\"33\" font-size=\"11\" fill=\"#555\">kernel {}, {}, QEMU TCG; dashed: reference tools</text>\n",
        esc(kernel),
        esc(date)
    );
    // Decade grid lines and labels.
    let mut d = lo;
    while d <= hi + 1e-9 {
        let y = py(10f64.powf(d));
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            label_secs(10f64.powf(d))
        ));
        d += 1.0;
    }
    for &x in &xs {
        let xp = px(x);
        s.push_str(&format!(
            "<line x1=\"{xp:.1}\" y1=\"{TOP}\" x2=\"{xp:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\n<text x=\"{xp:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            TOP + ph,
            TOP + ph + 18.0,
            x as u64
        ));
    }
    s.push_str(&format!(
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#333\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">services (N)</text>\n\
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">seconds (log)</text>\n",
        LEFT + pw / 2.0,
        H - 12.0,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    ));
    for (i, (label, colour, dashed, ptr)) in SERIES.iter().enumerate() {
        let pts: Vec<(f64, f64)> = runs
            .iter()
            .filter_map(|r| Some((r["services"].as_f64()?, r.pointer(ptr)?.as_f64()?)))
            .filter(|(_, v)| *v > 0.0 && v.is_finite())
            .map(|(x, v)| (px(x), py(v)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let dash = if *dashed {
            " stroke-dasharray=\"6 4\""
        } else {
            ""
        };
        s.push_str(&format!(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\n",
            path.join(" ")
        ));
        for (x, y) in &pts {
            s.push_str(&format!(
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{colour}\"/>\n"
            ));
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = LEFT + pw + 14.0;
        s.push_str(&format!(
            "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\n<text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            esc(label)
        ));
    }
    s.push_str("</svg>\n");
    s
}

fn label_secs(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0} s")
    } else {
        format!("{} ms", fmt_ms(v * 1000.0))
    }
}

fn fmt_ms(ms: f64) -> String {
    if ms >= 1.0 {
        format!("{ms:.0}")
    } else {
        format!("{ms}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plot_has_one_line_per_series_with_a_point_per_run() {
        let runs: Vec<Value> = (1..=3)
            .map(|i| {
                serde_json::json!({
                    "services": i * 1000,
                    "ipvsadm_restore_s": 4.0 * i as f64,
                    "p1": {"total_s": 1.0 * i as f64, "ipvs_s": 0.3 * i as f64},
                    "p4": {"total_s": 0.5, "ipvsadm_save_s": 0.7},
                    "p2": {"endpoint": {"wall_s": 0.002}, "add-service": {"wall_s": 0.004}},
                })
            })
            .collect();
        let svg = scaling_plot(&runs, 10, "6.1.0", "2026-11-22");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), SERIES.len());
        assert_eq!(svg.matches("<circle").count(), SERIES.len() * 3);
        assert!(svg.contains("ipvsadm --restore"));
        assert!(svg.contains("1 ms") && svg.contains("10 s"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }
}
