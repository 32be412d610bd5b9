//! The PNG plots of `llms bench switch`, drawn with `plotters` (bitmap backend, no font
//! backend: labels use the pixel font of `pixel_font.rs`): the CDF of switch latency per
//! manager, average switch latency against the KV budget, and the most active contexts under
//! 10 ms and 25 ms against the budget. Latencies are on a log scale; each manager keeps one
//! colour in every plot ([`colour_name`], also in the JSON report).

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::pixel_font::{Align, draw as text};
use crate::switch::{Active, Run};

/// Each manager's colour: the paper's system in blues, greens and purple, the baselines in
/// warm colours and black, the llama.cpp peer rows in olive and pink.
const COLOURS: [(&str, (u8, u8, u8), &str); 10] = [
    ("llms", (0, 90, 255), "blue"),
    ("llms-no-compression", (0, 190, 210), "cyan"),
    ("llms-no-pipeline", (0, 160, 0), "green"),
    ("llms-no-lifecycle", (150, 0, 200), "purple"),
    ("vllm-sq", (230, 0, 0), "red"),
    ("vllm-s", (255, 140, 0), "orange"),
    ("swapping", (140, 80, 20), "brown"),
    ("lmk", (0, 0, 0), "black"),
    ("llama.cpp", (128, 128, 0), "olive"),
    ("llama.cpp-f16", (230, 80, 160), "pink"),
];

fn colour(m: &str) -> RGBColor {
    COLOURS
        .iter()
        .find(|c| c.0 == m)
        .map_or(RGBColor(128, 128, 128), |c| RGBColor(c.1.0, c.1.1, c.1.2))
}

/// The name of a manager's colour in the plots (grey for a manager not listed).
pub fn colour_name(m: &str) -> &'static str {
    COLOURS.iter().find(|c| c.0 == m).map_or("grey", |c| c.2)
}

type Chart<'a> = ChartContext<
    'a,
    BitMapBackend<'a>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

fn err<E: std::fmt::Debug>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("cannot draw {}: {e:?}", path.display())
}

/// A number as a tick label: no trailing zeros.
fn num(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// One axis: its range (log10 of the value for a log axis), its ticks (position, label,
/// whether the grid line is dark) and its title.
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<(f64, String, bool)>,
    title: String,
}

impl Axis {
    /// A log10 axis over the positive values `v` (milliseconds): whole decades, a tick at every
    /// 1-2-5 step when it spans at most three decades, and at the latency bounds 10 and 25.
    fn log(v: impl Iterator<Item = f64>, title: &str) -> Axis {
        let (lo, hi) = v
            .filter(|x| *x > 0.0)
            .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
        let (lo, hi) = if lo > hi {
            (-1.0, 2.0)
        } else {
            let lo = lo.log10().floor().clamp(-3.0, 5.0);
            (lo, hi.log10().ceil().max(lo + 1.0).min(6.0))
        };
        let steps: &[f64] = if hi - lo <= 3.0 {
            &[1.0, 2.0, 5.0]
        } else {
            &[1.0]
        };
        let mut ticks = Vec::new();
        let mut d = lo;
        while d <= hi + 1e-9 {
            for &m in steps {
                let x = d + m.log10();
                if x <= hi + 1e-9 {
                    ticks.push((x, num(10f64.powf(x)), m == 1.0));
                }
            }
            d += 1.0;
        }
        for b in [10.0f64, 25.0] {
            let x = b.log10();
            if (lo..=hi).contains(&x) && !ticks.iter().any(|t| (t.0 - x).abs() < 1e-9) {
                ticks.push((x, num(b), true));
            }
        }
        Axis {
            lo,
            hi,
            ticks,
            title: title.into(),
        }
    }

    /// A linear axis over `lo..hi` with ticks at `at`.
    fn linear(lo: f64, hi: f64, at: &[f64], title: &str) -> Axis {
        Axis {
            lo,
            hi,
            ticks: at.iter().map(|&t| (t, num(t), false)).collect(),
            title: title.into(),
        }
    }
}

const SIZE: (u32, u32) = (1060, 640);
/// Plotting area margins: top, bottom, left, right (the legend is in the right one).
const MARGIN: (i32, i32, i32, i32) = (44, 64, 80, 300);

/// Draws one plot: the title, the axes with their grid, ticks and titles, the legend, and
/// whatever `series` draws in data coordinates.
fn plot(
    path: &Path,
    title: &str,
    x: &Axis,
    y: &Axis,
    legend: &[(String, RGBColor)],
    series: impl FnOnce(&mut Chart<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let root: DrawingArea<BitMapBackend<'_>, Shift> =
        BitMapBackend::new(path, SIZE).into_drawing_area();
    let e = err(path);
    root.fill(&WHITE).map_err(&e)?;
    let dark = RGBColor(40, 40, 40);
    text(
        &root,
        title,
        (SIZE.0 as i32 / 2, 6),
        Align::Centre,
        2,
        &dark,
    )
    .map_err(&e)?;
    let area = root.margin(MARGIN.0, MARGIN.1, MARGIN.2, MARGIN.3);
    let mut chart = ChartBuilder::on(&area)
        .build_cartesian_2d(x.lo..x.hi, y.lo..y.hi)
        .map_err(&e)?;
    let line =
        |dark: bool| ShapeStyle::from(&BLACK.mix(if dark { 0.45 } else { 0.12 })).stroke_width(1);
    for (t, _, d) in &x.ticks {
        chart
            .draw_series(LineSeries::new([(*t, y.lo), (*t, y.hi)], line(*d)))
            .map_err(&e)?;
    }
    for (t, _, d) in &y.ticks {
        chart
            .draw_series(LineSeries::new([(x.lo, *t), (x.hi, *t)], line(*d)))
            .map_err(&e)?;
    }
    chart
        .draw_series(LineSeries::new(
            [
                (x.lo, y.lo),
                (x.hi, y.lo),
                (x.hi, y.hi),
                (x.lo, y.hi),
                (x.lo, y.lo),
            ],
            BLACK.mix(0.7).stroke_width(1),
        ))
        .map_err(&e)?;
    series(&mut chart)?;
    for (t, label, _) in &x.ticks {
        let (px, py) = chart.backend_coord(&(*t, y.lo));
        text(&root, label, (px, py + 12), Align::Centre, 2, &dark).map_err(&e)?;
    }
    for (t, label, _) in &y.ticks {
        let (px, py) = chart.backend_coord(&(x.lo, *t));
        text(&root, label, (px - 8, py - 7), Align::Right, 2, &dark).map_err(&e)?;
    }
    let (cx, bottom) = chart.backend_coord(&((x.lo + x.hi) / 2.0, y.lo));
    text(&root, &x.title, (cx, bottom + 34), Align::Centre, 2, &dark).map_err(&e)?;
    let (left, top) = chart.backend_coord(&(x.lo, y.hi));
    text(
        &root,
        &y.title,
        (left - 70, top - 18),
        Align::Left,
        2,
        &dark,
    )
    .map_err(&e)?;
    let lx = SIZE.0 as i32 - MARGIN.3 + 16;
    for (i, (name, c)) in legend.iter().enumerate() {
        let ly = MARGIN.0 + 8 + i as i32 * 24;
        root.draw(&Rectangle::new(
            [(lx, ly + 5), (lx + 24, ly + 8)],
            c.filled(),
        ))
        .map_err(&e)?;
        text(&root, name, (lx + 32, ly), Align::Left, 2, c).map_err(&e)?;
    }
    root.present().map_err(&e)?;
    Ok(())
}

/// The switch latencies of a run's switches, sorted, at least 1 µs (for the log axis).
fn switch_samples(r: &Run) -> Vec<f64> {
    let mut v: Vec<f64> = r
        .call_log
        .iter()
        .filter(|c| c.switched && !c.start && c.error.is_none())
        .map(|c| c.switch_ms.max(1e-3))
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

/// An x axis over the budgets measured, a tick at each, with room on both sides.
fn budget_axis(xs: &[f64], in_contexts: bool) -> Axis {
    let (lo, hi) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo > hi { (0.0, 1.0) } else { (lo, hi) };
    let pad = ((hi - lo) * 0.1).max(0.5);
    let mut at = xs.to_vec();
    at.sort_by(f64::total_cmp);
    at.dedup();
    Axis::linear(
        (lo - pad).max(0.0),
        hi + pad,
        &at,
        if in_contexts {
            "kv budget, contexts' worth (int8 at the trace's cap)"
        } else {
            "kv budget, mib"
        },
    )
}

/// Draws the three plots into `out`; returns their paths.
pub fn draw(
    out: &Path,
    runs: &[Run],
    active: &[Active],
    managers: &[String],
) -> anyhow::Result<Vec<PathBuf>> {
    let Some(first) = runs.first() else {
        return Ok(Vec::new());
    };
    let plots = Plots {
        out,
        runs,
        active,
        managers,
        first,
        most: runs.iter().map(|r| r.contexts).max().unwrap_or(0),
        legend: managers.iter().map(|m| (m.clone(), colour(m))).collect(),
        in_contexts: first.budget.contexts.is_some(),
    };
    Ok(vec![
        plots.cdf()?,
        plots.latency_vs_budget()?,
        plots.active_vs_budget()?,
    ])
}

/// What the three plots share: the runs, the first one (its budget is the CDF's), the most
/// contexts of any run, and each manager's line in the legend.
struct Plots<'a> {
    out: &'a Path,
    runs: &'a [Run],
    active: &'a [Active],
    managers: &'a [String],
    first: &'a Run,
    most: usize,
    legend: Vec<(String, RGBColor)>,
    /// Whether the budgets are in contexts' worth (else MiB).
    in_contexts: bool,
}

impl Plots<'_> {
    /// 1. The CDF of switch latency: the first budget, the most contexts.
    fn cdf(&self) -> anyhow::Result<PathBuf> {
        let (first, most) = (self.first, self.most);
        let path = self.out.join("switch-cdf.png");
        let sel: Vec<&Run> = self
            .runs
            .iter()
            .filter(|r| r.budget.bytes == first.budget.bytes && r.contexts == most)
            .collect();
        let x = Axis::log(
            sel.iter().flat_map(|r| switch_samples(r)),
            "switch latency, ms (log scale)",
        );
        let mut y = Axis::linear(
            0.0,
            1.0,
            &[0.0, 0.25, 0.5, 0.75, 0.9, 1.0],
            "share of switches",
        );
        y.ticks.push((0.99, String::new(), false));
        let title = format!(
            "switch latency cdf: {}, {most} contexts",
            first.budget.label()
        );
        plot(&path, &title, &x, &y, &self.legend, |chart| {
            for r in &sel {
                let v = switch_samples(r);
                let n = v.len() as f64;
                let pts: Vec<(f64, f64)> = v
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &ms)| {
                        let lx = ms.log10().clamp(x.lo, x.hi);
                        [(lx, i as f64 / n), (lx, (i + 1) as f64 / n)]
                    })
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts, colour(&r.manager).stroke_width(3)))
                    .map_err(err(&path))?;
            }
            Ok(())
        })?;
        Ok(path)
    }

    /// 2. Average switch latency against the budget, the most contexts.
    fn latency_vs_budget(&self) -> anyhow::Result<PathBuf> {
        let most = self.most;
        let path = self.out.join("switch-vs-budget.png");
        let sel: Vec<&Run> = self.runs.iter().filter(|r| r.contexts == most).collect();
        let xs: Vec<f64> = sel.iter().map(|r| r.budget.x()).collect();
        let x = budget_axis(&xs, self.in_contexts);
        let y = Axis::log(
            sel.iter().map(|r| r.switch_avg_ms.max(1e-3)),
            "average switch latency, ms (log scale)",
        );
        let title = format!("average switch latency against the kv budget, {most} contexts");
        plot(&path, &title, &x, &y, &self.legend, |chart| {
            for m in self.managers {
                let mut pts: Vec<(f64, f64)> = sel
                    .iter()
                    .filter(|r| &r.manager == m && r.switches > 0)
                    .map(|r| {
                        (
                            r.budget.x(),
                            r.switch_avg_ms.max(1e-3).log10().clamp(y.lo, y.hi),
                        )
                    })
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let c = colour(m);
                chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(err(&path))?;
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 6, c.filled())))
                    .map_err(err(&path))?;
            }
            Ok(())
        })?;
        Ok(path)
    }

    /// 3. The most active contexts under 10 ms (filled, thick) and 25 ms (hollow, thin).
    fn active_vs_budget(&self) -> anyhow::Result<PathBuf> {
        let (managers, most) = (self.managers, self.most);
        let path = self.out.join("active-vs-budget.png");
        let xs: Vec<f64> = self.active.iter().map(|a| a.budget.x()).collect();
        let x = budget_axis(&xs, self.in_contexts);
        let at: Vec<f64> = (0..=most).map(|n| n as f64).collect();
        let y = Axis::linear(-0.5, most.max(1) as f64 + 0.5, &at, "active contexts");
        let title = "most active contexts: avg switch < 10 ms (filled), < 25 ms (hollow)";
        plot(&path, title, &x, &y, &self.legend, |chart| {
            for (k, m) in managers.iter().enumerate() {
                // Managers tied at a point are nudged apart so each stays visible.
                let dy = (k as f64 - managers.len() as f64 / 2.0) * 0.04;
                let c = colour(m);
                for filled in [true, false] {
                    let mut pts: Vec<(f64, f64)> = self
                        .active
                        .iter()
                        .filter(|a| &a.manager == m)
                        .map(|a| {
                            let n = if filled { a.under_10ms } else { a.under_25ms };
                            (a.budget.x(), n as f64 + dy)
                        })
                        .collect();
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let style = c.stroke_width(if filled { 2 } else { 1 });
                    chart
                        .draw_series(LineSeries::new(pts.clone(), style))
                        .map_err(err(&path))?;
                    chart
                        .draw_series(pts.iter().map(|&p| {
                            if filled {
                                Circle::new(p, 6, c.filled())
                            } else {
                                Circle::new(p, 9, c.stroke_width(2))
                            }
                        }))
                        .map_err(err(&path))?;
                }
            }
            Ok(())
        })?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels() {
        assert_eq!(num(10.0), "10");
        assert_eq!(num(0.5), "0.5");
        assert_eq!(num(0.25), "0.25");
        assert_eq!(num(2.0), "2");
        assert_eq!(num(0.0), "0");
        let a = Axis::log([0.3, 40.0].into_iter(), "ms");
        assert_eq!((a.lo, a.hi), (-1.0, 2.0));
        let labels: Vec<&str> = a.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(
            labels,
            [
                "0.1", "0.2", "0.5", "1", "2", "5", "10", "20", "50", "100", "25"
            ]
        );
        // Over more than three decades, decades only (and the bounds).
        let a = Axis::log([0.01, 5000.0].into_iter(), "ms");
        let labels: Vec<&str> = a.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(
            labels,
            ["0.01", "0.1", "1", "10", "100", "1000", "10000", "25"]
        );
        // Nothing to show: a default range, not a panic.
        let a = Axis::log(std::iter::empty(), "ms");
        assert!(a.lo < a.hi);
    }
}
