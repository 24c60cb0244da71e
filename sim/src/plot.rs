//! `--plot DIR`: SVG line charts of one run, written by hand (plain SVG 1.1, no script,
//! no external style), from the [`Series`] the simulator records when asked:
//!
//! - `admitted.svg`: the fleet's admitted rate against the limit (the sum of the keys'
//!   `R`), beside what one ideal bucket admitted and what was offered, 100 ms bins;
//! - `slices.svg`: each agent's slice rate for one key over time (the first 32 agents),
//!   their sum, and the key's `R`;
//! - `overshoot.svg`: the same key's measured overshoot (the verifier's deepest deficit
//!   so far), its deficit at each instant, and the bound stated so far, in units of `B`.
//!
//! The key charted is the one with the largest final overshoot among the first
//! [`crate::sim::SERIES_KEYS_MAX`] keys (the first on a tie).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::sim::{Report, Series};

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Legend entries drawn (the rest are summarised in one line).
const LEGEND_MAX: usize = 12;
/// Colours for agents and series, cycled.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Line {
    /// Legend text.
    pub name: String,
    /// Stroke colour.
    pub color: String,
    /// Stroke width, px.
    pub width: f64,
    /// Dashed (limits and bounds).
    pub dashed: bool,
    /// `(x, y)` points, in order of `x`.
    pub points: Vec<(f64, f64)>,
}

impl Line {
    fn new(name: impl Into<String>, color: &str, points: Vec<(f64, f64)>) -> Line {
        Line {
            name: name.into(),
            color: color.to_string(),
            width: 1.5,
            dashed: false,
            points,
        }
    }

    fn dashed(mut self) -> Line {
        self.dashed = true;
        self
    }
}

/// A line chart.
#[derive(Clone, Debug)]
pub struct Chart {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// The lines.
    pub lines: Vec<Line>,
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A tick step of 1, 2 or 5 times a power of ten giving about `n` ticks over `range`.
fn nice_step(range: f64, n: f64) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / n;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v.abs() >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if step >= 1.0 {
        format!("{v:.0}")
    } else if step >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

impl Chart {
    /// The chart as an SVG document.
    pub fn to_svg(&self) -> String {
        let xs = self.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(x), b.max(x))
        });
        let (x0, x1) = if x0.is_finite() && x1 > x0 {
            (x0, x1)
        } else {
            (0.0, 1.0)
        };
        let y_max = self
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .fold(0.0f64, f64::max);
        let y_step = nice_step(if y_max > 0.0 { y_max } else { 1.0 }, 5.0);
        let y1 = ((y_max / y_step).ceil() * y_step).max(y_step);
        let pw = WIDTH - LEFT - RIGHT;
        let ph = HEIGHT - TOP - BOTTOM;
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + ph - y / y1 * ph;
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">
<title>{}</title>
<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>
<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
            esc(&self.title),
            LEFT + pw / 2.0,
            esc(&self.title)
        );
        // Grid and ticks.
        let _ = writeln!(o, r##"<g stroke="#dddddd" stroke-width="1">"##);
        let mut y = 0.0;
        while y <= y1 + y_step * 1e-9 {
            let _ = writeln!(
                o,
                r#"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}"/>"#,
                sy(y),
                LEFT + pw
            );
            y += y_step;
        }
        let x_step = nice_step(x1 - x0, 8.0);
        let mut x = (x0 / x_step).ceil() * x_step;
        while x <= x1 + x_step * 1e-9 {
            let _ = writeln!(
                o,
                r#"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}"/>"#,
                sx(x),
                TOP + ph
            );
            x += x_step;
        }
        let _ = writeln!(o, "</g>");
        let _ = writeln!(o, r#"<g fill="black">"#);
        let mut y = 0.0;
        while y <= y1 + y_step * 1e-9 {
            let _ = writeln!(
                o,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                sy(y) + 4.0,
                fmt_tick(y, y_step)
            );
            y += y_step;
        }
        let mut x = (x0 / x_step).ceil() * x_step;
        while x <= x1 + x_step * 1e-9 {
            let _ = writeln!(
                o,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                sx(x),
                TOP + ph + 16.0,
                fmt_tick(x, x_step)
            );
            x += x_step;
        }
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>
<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>
</g>"#,
            LEFT + pw / 2.0,
            HEIGHT - 10.0,
            esc(&self.x_label),
            TOP + ph / 2.0,
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        let _ = writeln!(
            o,
            r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444444"/>"##
        );
        // Lines.
        for l in &self.lines {
            if l.points.is_empty() {
                continue;
            }
            let mut pts = String::with_capacity(l.points.len() * 12);
            for &(x, y) in &l.points {
                let _ = write!(pts, "{:.1},{:.1} ", sx(x), sy(y.clamp(0.0, y1)));
            }
            let _ = writeln!(
                o,
                r#"<polyline fill="none" stroke="{}" stroke-width="{}"{} points="{}"><title>{}</title></polyline>"#,
                esc(&l.color),
                l.width,
                if l.dashed {
                    r#" stroke-dasharray="6 4""#
                } else {
                    ""
                },
                pts.trim_end(),
                esc(&l.name)
            );
        }
        // Legend.
        let lx = LEFT + pw + 14.0;
        let _ = writeln!(o, "<g>");
        for (i, l) in self.lines.iter().take(LEGEND_MAX).enumerate() {
            let ly = TOP + 10.0 + i as f64 * 18.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"{}/>
<text x="{}" y="{}">{}</text>"#,
                lx + 22.0,
                esc(&l.color),
                if l.dashed {
                    r#" stroke-dasharray="6 4""#
                } else {
                    ""
                },
                lx + 28.0,
                ly + 4.0,
                esc(&l.name)
            );
        }
        if self.lines.len() > LEGEND_MAX {
            let ly = TOP + 10.0 + LEGEND_MAX as f64 * 18.0;
            let _ = writeln!(
                o,
                r#"<text x="{lx}" y="{}">and {} more</text>"#,
                ly + 4.0,
                self.lines.len() - LEGEND_MAX
            );
        }
        let _ = writeln!(o, "</g>\n</svg>");
        o
    }
}

/// The three charts of one run (see the module docs).
pub fn charts(report: &Report, series: &Series) -> Vec<(&'static str, Chart)> {
    let scen = format!(
        "{} seed {} policy {}",
        report.scenario, report.seed, report.policy
    );
    let t = |i: usize| (i as f64 + 0.5) * series.bin_s;
    let rate = |v: &[u64]| -> Vec<(f64, f64)> {
        v.iter()
            .enumerate()
            .map(|(i, &x)| (t(i), x as f64 / series.bin_s))
            .collect()
    };
    let end_s = series.admitted.len() as f64 * series.bin_s;
    let admitted = Chart {
        title: format!("Fleet admitted rate against the limit ({scen})"),
        x_label: "virtual time since traffic started, s".into(),
        y_label: "tokens per second, all keys".into(),
        lines: vec![
            Line::new("offered", "#bbbbbb", rate(&series.offered)),
            Line::new("one ideal bucket", PALETTE[2], rate(&series.ideal)),
            Line::new("fleet admitted", PALETTE[0], rate(&series.admitted)),
            Line::new(
                "limit (sum of R)",
                PALETTE[3],
                vec![
                    (0.0, series.limit_rate_per_s),
                    (end_s, series.limit_rate_per_s),
                ],
            )
            .dashed(),
        ],
    };
    // The key with the largest final overshoot among those recorded.
    let key = series.keys.iter().enumerate().fold(None, |best, (i, k)| {
        let o = k.overshoot.last().copied().unwrap_or(0.0);
        match best {
            Some((_, b)) if b >= o => best,
            _ => Some((i, o)),
        }
    });
    let mut out = vec![("admitted.svg", admitted)];
    let Some((ki, _)) = key else {
        return out;
    };
    let k = &series.keys[ki];
    let ts = &series.sample_s;
    let mut lines: Vec<Line> = Vec::new();
    let n = ts.len();
    let mut sum = vec![0u64; n];
    for (ai, sl) in k.slices.iter().enumerate() {
        for (s, &r) in sum.iter_mut().zip(sl) {
            *s += r;
        }
        let mut l = Line::new(
            series.agents[ai].clone(),
            PALETTE[ai % PALETTE.len()],
            ts.iter().zip(sl).map(|(&t, &r)| (t, r as f64)).collect(),
        );
        l.width = 1.0;
        lines.push(l);
    }
    let r = series.rate_per_s;
    lines.insert(
        0,
        Line::new(
            format!("sum ({} agents)", k.slices.len()),
            "#000000",
            ts.iter().zip(&sum).map(|(&t, &r)| (t, r as f64)).collect(),
        ),
    );
    lines.insert(
        1,
        Line::new("R", PALETTE[3], vec![(0.0, r), (end_s, r)]).dashed(),
    );
    out.push((
        "slices.svg",
        Chart {
            title: format!("Per-agent slices of {} ({scen})", k.name),
            x_label: "virtual time since traffic started, s".into(),
            y_label: "slice rate, tokens per second".into(),
            lines,
        },
    ));
    let b = k.burst.max(1) as f64;
    let frac =
        |v: &[f64]| -> Vec<(f64, f64)> { ts.iter().zip(v).map(|(&t, &x)| (t, x / b)).collect() };
    out.push((
        "overshoot.svg",
        Chart {
            title: format!("Overshoot against the stated bound, {} ({scen})", k.name),
            x_label: "virtual time since traffic started, s".into(),
            y_label: "excess over one bucket (R, B), units of B".into(),
            lines: vec![
                Line::new("bound (stated so far)", PALETTE[3], frac(&k.bound)).dashed(),
                Line::new("overshoot (deepest)", PALETTE[0], frac(&k.overshoot)),
                Line::new("deficit now", PALETTE[1], frac(&k.deficit)),
            ],
        },
    ));
    out
}

/// Writes the charts into `dir` (created if missing) and returns their paths.
pub fn write_charts(dir: &Path, report: &Report, series: &Series) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::new();
    for (name, chart) in charts(report, series) {
        let path = dir.join(name);
        std::fs::write(&path, chart.to_svg())?;
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert_eq!(nice_step(24_000.0, 5.0), 5_000.0);
        assert_eq!(nice_step(0.9, 5.0), 0.2);
        assert_eq!(nice_step(0.0, 5.0), 1.0);
    }

    #[test]
    fn text_is_escaped() {
        let c = Chart {
            title: "a<b & \"c\"".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            lines: vec![Line::new("k{t0}<", "#000", vec![(0.0, 1.0), (1.0, 2.0)])],
        };
        let svg = c.to_svg();
        assert!(svg.contains("a&lt;b &amp; &quot;c&quot;"));
        assert!(svg.contains("k{t0}&lt;"));
        assert!(!svg.contains("a<b"));
    }
}
