//! Tiny hand-written SVG line plots rendered from the bench JSON: time (log scale) vs number of
//! services, one line per measured series (controller runs and daemon entries), and the
//! daemon's RSS (linear) vs number of services.

use serde_json::Value;

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 50.0;

/// Which JSON list a series reads.
#[derive(Clone, Copy, PartialEq)]
enum From {
    /// controller-bench runs.
    Runs,
    /// daemon-bench entries.
    Daemon,
}

/// (label, colour, dashed, source, JSON pointer into an entry).
type Series = (&'static str, &'static str, bool, From, &'static str);

const SERIES: [Series; 12] = [
    (
        "ipvsadm --restore",
        "#d62728",
        true,
        From::Runs,
        "/ipvsadm_restore_s",
    ),
    (
        "P1 full program (total)",
        "#1f77b4",
        false,
        From::Runs,
        "/p1/total_s",
    ),
    ("P1 IPVS part", "#17becf", false, From::Runs, "/p1/ipvs_s"),
    (
        "ipvsadm -Sn",
        "#ff7f0e",
        true,
        From::Runs,
        "/p4/ipvsadm_save_s",
    ),
    (
        "P4 drift check (total)",
        "#2ca02c",
        false,
        From::Runs,
        "/p4/total_s",
    ),
    (
        "P2 add service",
        "#9467bd",
        false,
        From::Runs,
        "/p2/add-service/wall_s",
    ),
    (
        "P2 one endpoint",
        "#8c564b",
        false,
        From::Runs,
        "/p2/endpoint/wall_s",
    ),
    (
        "ipvsadm --restore",
        "#d62728",
        true,
        From::Daemon,
        "/restore_s",
    ),
    (
        "daemon, API: start→converged",
        "#e377c2",
        false,
        From::Daemon,
        "/api/converge_s",
    ),
    (
        "daemon, dir: start→converged",
        "#7f7f7f",
        false,
        From::Daemon,
        "/dir/converge_s",
    ),
    (
        "daemon, API: one endpoint",
        "#bcbd22",
        false,
        From::Daemon,
        "/api/change_median_s",
    ),
    (
        "daemon, dir: one endpoint",
        "#000000",
        false,
        From::Daemon,
        "/dir/change_median_s",
    ),
];

/// (label, colour, dashed, source, pointer, divisor) of the RSS plot (kB → MiB).
const RSS_SERIES: [Series; 5] = [
    (
        "daemon, API: steady",
        "#e377c2",
        false,
        From::Daemon,
        "/api/rss_steady_kb",
    ),
    (
        "daemon, API: peak",
        "#e377c2",
        true,
        From::Daemon,
        "/api/rss_peak_kb",
    ),
    (
        "daemon, dir: steady",
        "#7f7f7f",
        false,
        From::Daemon,
        "/dir/rss_steady_kb",
    ),
    (
        "daemon, dir: peak",
        "#7f7f7f",
        true,
        From::Daemon,
        "/dir/rss_peak_kb",
    ),
    (
        "controller driver: steady",
        "#1f77b4",
        false,
        From::Runs,
        "/p3/rss_steady_kb",
    ),
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The points (N, value) of one series.
fn points(series: &Series, runs: &[Value], daemon: &[Value], scale: f64) -> Vec<(f64, f64)> {
    let list = match series.3 {
        From::Runs => runs,
        From::Daemon => daemon,
    };
    list.iter()
        .filter_map(|r| {
            Some((
                r["services"].as_f64()?,
                r.pointer(series.4)?.as_f64()? * scale,
            ))
        })
        .filter(|(_, v)| *v > 0.0 && v.is_finite())
        .collect()
}

/// Frame, title, y grid (`ticks`: (value, label)), x grid for `xs`.
fn frame(title: &str, sub: &str, y_label: &str, xs: &[f64], ticks: &[(f64, String)]) -> String {
    let xmax = xs.iter().copied().fold(1.0, f64::max);
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"18\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
         <text x=\"{LEFT}\" y=\"33\" font-size=\"11\" fill=\"#555\">{}</text>\n",
        esc(title),
        esc(sub)
    );
    for (y, label) in ticks {
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            esc(label)
        ));
    }
    for &x in xs {
        let xp = LEFT + x / xmax * pw;
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
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">{}</text>\n",
        LEFT + pw / 2.0,
        H - 12.0,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(y_label)
    ));
    s
}

/// Every series that has points, each `scale`d and mapped to the plot by `px`/`py`, with its
/// legend entry in the next slot.
fn lines(
    all: &[Series],
    runs: &[Value],
    daemon: &[Value],
    scale: f64,
    px: &dyn Fn(f64) -> f64,
    py: &dyn Fn(f64) -> f64,
) -> String {
    let mut out = String::new();
    let mut slot = 0;
    for series in all {
        let pts: Vec<(f64, f64)> = points(series, runs, daemon, scale)
            .into_iter()
            .map(|(x, v)| (px(x), py(v)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        out.push_str(&line(&pts, series.1, series.2, series.0, slot));
        slot += 1;
    }
    out
}

/// One polyline with its points and legend entry (`slot`: legend row).
fn line(pts: &[(f64, f64)], colour: &str, dashed: bool, label: &str, slot: usize) -> String {
    let pw = W - LEFT - RIGHT;
    let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
    let dash = if dashed {
        " stroke-dasharray=\"6 4\""
    } else {
        ""
    };
    let mut s = format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\n",
        path.join(" ")
    );
    for (x, y) in pts {
        s.push_str(&format!(
            "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{colour}\"/>\n"
        ));
    }
    let ly = TOP + 10.0 + slot as f64 * 20.0;
    let lx = LEFT + pw + 14.0;
    s.push_str(&format!(
        "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\n<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{}</text>\n",
        lx + 24.0,
        lx + 30.0,
        ly + 4.0,
        esc(label)
    ));
    s
}

fn all_xs(runs: &[Value], daemon: &[Value]) -> Vec<f64> {
    let mut xs: Vec<f64> = runs
        .iter()
        .chain(daemon)
        .filter_map(|r| r["services"].as_f64())
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs
}

/// Renders the time plot of `runs` (controller) and `daemon` entries (each with `services` and
/// the series' fields).
pub fn scaling_plot(
    runs: &[Value],
    daemon: &[Value],
    reals: usize,
    kernel: &str,
    date: &str,
) -> String {
    let xs = all_xs(runs, daemon);
    let xmax = xs.iter().copied().fold(1.0, f64::max);
    let vals: Vec<f64> = SERIES
        .iter()
        .flat_map(|s| points(s, runs, daemon, 1.0))
        .map(|(_, v)| v)
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
    let mut ticks = Vec::new();
    let mut d = lo;
    while d <= hi + 1e-9 {
        ticks.push((py(10f64.powf(d)), label_secs(10f64.powf(d))));
        d += 1.0;
    }
    let mut s = frame(
        &format!(
            "kube-ipvs{}: time vs services ({reals} reals each)",
            if runs.is_empty() { " daemon" } else { "" }
        ),
        &format!("kernel {kernel}, {date}, QEMU TCG; dashed: reference tools"),
        "seconds (log)",
        &xs,
        &ticks,
    );
    s.push_str(&lines(&SERIES, runs, daemon, 1.0, &px, &py));
    s.push_str("</svg>\n");
    s
}

/// Renders the RSS plot (MiB, linear) of the daemon entries, with the controller driver's steady
/// RSS for comparison and issue #18's targets at 10,000 services as dotted lines.
pub fn rss_plot(
    runs: &[Value],
    daemon: &[Value],
    reals: usize,
    kernel: &str,
    date: &str,
) -> String {
    let xs = all_xs(runs, daemon);
    let xmax = xs.iter().copied().fold(1.0, f64::max);
    let mib = 1.0 / 1024.0;
    let top = RSS_SERIES
        .iter()
        .flat_map(|s| points(s, runs, daemon, mib))
        .map(|(_, v)| v)
        .fold(80.0, f64::max);
    let step = if top > 400.0 { 100.0 } else { 50.0 };
    let ymax = (top / step).ceil() * step;
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |x: f64| LEFT + x / xmax * pw;
    let py = |v: f64| TOP + (1.0 - v / ymax) * ph;
    let ticks: Vec<(f64, String)> = (0..=(ymax / step) as u32)
        .map(|i| {
            let v = f64::from(i) * step;
            (py(v), format!("{v:.0}"))
        })
        .collect();
    let mut s = frame(
        &format!("kube-ipvs daemon: RSS vs services ({reals} reals each)"),
        &format!("kernel {kernel}, {date}, QEMU TCG; dotted: targets at 10,000 (55 / 80 MiB)"),
        "MiB",
        &xs,
        &ticks,
    );
    for t in [55.0, 80.0] {
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#2ca02c\" stroke-dasharray=\"2 3\"/>\n",
            LEFT + pw,
            y = py(t)
        ));
    }
    s.push_str(&lines(&RSS_SERIES, runs, daemon, mib, &px, &py));
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
        let svg = scaling_plot(&runs, &[], 10, "6.1.0", "2026-11-22");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        let controller = SERIES.iter().filter(|s| s.3 == From::Runs).count();
        assert_eq!(svg.matches("<polyline").count(), controller);
        assert_eq!(svg.matches("<circle").count(), controller * 3);
        assert!(svg.contains("ipvsadm --restore"));
        assert!(svg.contains("1 ms") && svg.contains("10 s"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn daemon_entries_add_their_lines_and_the_rss_plot() {
        let daemon: Vec<Value> = (1..=2)
            .map(|i| {
                let src = serde_json::json!({
                    "converge_s": 2.0 * i as f64, "change_median_s": 0.01,
                    "rss_steady_kb": 40_000.0 * i as f64, "rss_peak_kb": 60_000.0 * i as f64,
                });
                serde_json::json!({"services": i * 1000, "restore_s": 5.0 * i as f64,
                                   "api": src, "dir": src})
            })
            .collect();
        // The daemon's own restore is its reference line.
        let svg = scaling_plot(&[], &daemon, 10, "6.1.0", "2026-11-25");
        assert_eq!(svg.matches("<polyline").count(), 5, "{svg}");
        assert!(svg.contains("daemon, dir: one endpoint") && svg.contains("ipvsadm --restore"));
        let rss = rss_plot(&[], &daemon, 10, "6.1.0", "2026-11-25");
        assert_eq!(rss.matches("<polyline").count(), 4, "{rss}");
        // 2 x 60,000 kB = 117 MiB peak: the axis reaches 150.
        assert!(rss.contains(">150<"), "{rss}");
        assert!(!rss.contains("NaN") && !rss.contains("inf"));
    }
}
