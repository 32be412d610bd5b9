//! The PNG plots of `llms bench switch`, drawn with `plotters` as `llms eval sweep`'s are: the
//! workspace builds plotters without a font backend, so a plot carries no text. Each manager has
//! a fixed colour ([`colour_name`], also in the JSON report), latencies are on a log scale with a
//! grid line at every 1-2-5 step and darker lines at 1, 10 and 100 ms, and docs/bench.md says
//! what each axis holds.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use plotters::prelude::*;

use crate::bench_switch::{Active, Run};

/// Each manager's colour, by name: the paper's system in blues and greens, the baselines in
/// warm colours and greys.
const COLOURS: [(&str, (u8, u8, u8), &str); 8] = [
    ("llms", (0, 90, 255), "blue"),
    ("llms-no-compression", (0, 200, 220), "cyan"),
    ("llms-no-pipeline", (0, 170, 0), "green"),
    ("llms-no-lifecycle", (150, 0, 200), "purple"),
    ("vllm-sq", (230, 0, 0), "red"),
    ("vllm-s", (255, 140, 0), "orange"),
    ("swapping", (120, 70, 20), "brown"),
    ("lmk", (0, 0, 0), "black"),
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

fn grid(alpha: f64) -> ShapeStyle {
    ShapeStyle::from(&BLACK.mix(alpha)).stroke_width(1)
}

/// A log10 range around the latencies `v` (ms): whole decades from 0.1 ms.
fn decades(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v
        .filter(|x| *x > 0.0)
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if lo > hi {
        return (-1.0, 2.0);
    }
    let lo = lo.log10().floor().clamp(-2.0, 5.0);
    let hi = (hi.log10().ceil()).max(lo + 1.0).min(6.0);
    (lo, hi)
}

/// Vertical (or horizontal) lines at every 1-2-5 step of a log10 axis, darker at each decade
/// and at the latency bounds (10 and 25 ms, when in range).
fn log_grid(
    chart: &mut Chart<'_>,
    lo: f64,
    hi: f64,
    other: (f64, f64),
    vertical: bool,
    path: &Path,
) -> anyhow::Result<()> {
    let mut lines = Vec::new();
    let mut d = lo;
    while d <= hi + 1e-9 {
        for (m, a) in [(1.0f64, 0.5), (2.0, 0.12), (5.0, 0.12)] {
            let x = d + m.log10();
            if x <= hi + 1e-9 {
                lines.push((x, a));
            }
        }
        d += 1.0;
    }
    lines.push((25f64.log10(), 0.5));
    for (x, a) in lines {
        let pts = if vertical {
            [(x, other.0), (x, other.1)]
        } else {
            [(other.0, x), (other.1, x)]
        };
        chart
            .draw_series(LineSeries::new(pts, grid(a)))
            .map_err(err(path))?;
    }
    Ok(())
}

/// Draws the three plots into `out`; returns their paths.
pub fn draw(
    out: &Path,
    runs: &[Run],
    active: &[Active],
    managers: &[String],
) -> anyhow::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    let Some(first) = runs.first() else {
        return Ok(paths);
    };
    let most = runs.iter().map(|r| r.contexts).max().unwrap_or(0);
    // 1. The CDF of switch latency, the first budget with the most contexts.
    let path = out.join("switch-cdf.png");
    {
        let sel: Vec<&Run> = runs
            .iter()
            .filter(|r| r.budget.bytes == first.budget.bytes && r.contexts == most)
            .collect();
        let samples = |r: &Run| {
            let mut v: Vec<f64> = r
                .call_log
                .iter()
                .filter(|c| c.switched && !c.start && c.error.is_none())
                .map(|c| c.switch_ms.max(1e-3))
                .collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (lo, hi) = decades(sel.iter().flat_map(|r| samples(r)));
        let root = BitMapBackend::new(&path, (960, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(err(&path))?;
        let area = root.margin(20, 20, 20, 20);
        let mut chart = ChartBuilder::on(&area)
            .build_cartesian_2d(lo..hi, 0.0f64..1.0)
            .map_err(err(&path))?;
        log_grid(&mut chart, lo, hi, (0.0, 1.0), true, &path)?;
        for y in [0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0] {
            chart
                .draw_series(LineSeries::new(
                    [(lo, y), (hi, y)],
                    grid(if y == 0.5 { 0.5 } else { 0.12 }),
                ))
                .map_err(err(&path))?;
        }
        for r in &sel {
            let v = samples(r);
            let n = v.len() as f64;
            let pts: Vec<(f64, f64)> = v
                .iter()
                .enumerate()
                .flat_map(|(i, &x)| {
                    let x = x.log10().clamp(lo, hi);
                    [(x, i as f64 / n), (x, (i + 1) as f64 / n)]
                })
                .collect();
            chart
                .draw_series(LineSeries::new(pts, colour(&r.manager).stroke_width(3)))
                .map_err(err(&path))?;
        }
        root.present().map_err(err(&path))?;
    }
    paths.push(path);

    // 2. Average switch latency against the budget, with the most contexts.
    let path = out.join("switch-vs-budget.png");
    {
        let sel: Vec<&Run> = runs.iter().filter(|r| r.contexts == most).collect();
        let (lo, hi) = decades(sel.iter().map(|r| r.switch_avg_ms.max(1e-3)));
        let (x0, x1) = x_range(sel.iter().map(|r| r.budget.x()));
        let root = BitMapBackend::new(&path, (960, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(err(&path))?;
        let area = root.margin(20, 20, 20, 20);
        let mut chart = ChartBuilder::on(&area)
            .build_cartesian_2d(x0..x1, lo..hi)
            .map_err(err(&path))?;
        log_grid(&mut chart, lo, hi, (x0, x1), false, &path)?;
        budget_grid(
            &mut chart,
            sel.iter().map(|r| r.budget.x()),
            (lo, hi),
            &path,
        )?;
        for m in managers {
            let mut pts: Vec<(f64, f64)> = sel
                .iter()
                .filter(|r| &r.manager == m && r.switches > 0)
                .map(|r| {
                    (
                        r.budget.x(),
                        r.switch_avg_ms.max(1e-3).log10().clamp(lo, hi),
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
        root.present().map_err(err(&path))?;
    }
    paths.push(path);

    // 3. The most active contexts under 10 ms (filled, solid) and 25 ms (hollow, thin) against
    // the budget.
    let path = out.join("active-vs-budget.png");
    {
        let (x0, x1) = x_range(active.iter().map(|a| a.budget.x()));
        let ymax = most.max(1) as f64 + 0.5;
        let root = BitMapBackend::new(&path, (960, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(err(&path))?;
        let area = root.margin(20, 20, 20, 20);
        let mut chart = ChartBuilder::on(&area)
            .build_cartesian_2d(x0..x1, -0.5f64..ymax)
            .map_err(err(&path))?;
        for n in 0..=most {
            let y = n as f64;
            chart
                .draw_series(LineSeries::new(
                    [(x0, y), (x1, y)],
                    grid(if n == 0 { 0.5 } else { 0.12 }),
                ))
                .map_err(err(&path))?;
        }
        budget_grid(
            &mut chart,
            active.iter().map(|a| a.budget.x()),
            (-0.5, ymax),
            &path,
        )?;
        for (k, m) in managers.iter().enumerate() {
            // Managers tied at a point are nudged apart so each stays visible.
            let dy = (k as f64 - managers.len() as f64 / 2.0) * 0.04;
            let c = colour(m);
            for (under, filled) in [(true, true), (false, false)] {
                let mut pts: Vec<(f64, f64)> = active
                    .iter()
                    .filter(|a| &a.manager == m)
                    .map(|a| {
                        let n = if under { a.under_10ms } else { a.under_25ms };
                        (a.budget.x(), n as f64 + dy)
                    })
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let style = if filled {
                    c.stroke_width(2)
                } else {
                    c.stroke_width(1)
                };
                chart
                    .draw_series(LineSeries::new(pts.clone(), style))
                    .map_err(err(&path))?;
                chart
                    .draw_series(pts.iter().map(|&p| {
                        if filled {
                            Circle::new(p, 6, c.filled())
                        } else {
                            Circle::new(p, 8, c.stroke_width(2))
                        }
                    }))
                    .map_err(err(&path))?;
            }
        }
        root.present().map_err(err(&path))?;
    }
    paths.push(path);
    Ok(paths)
}

/// An x range around the budgets, with room on both sides (one budget: centred).
fn x_range(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if lo > hi {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.1).max(0.5);
    ((lo - pad).max(0.0), hi + pad)
}

/// A vertical line at every budget measured.
fn budget_grid(
    chart: &mut Chart<'_>,
    xs: impl Iterator<Item = f64>,
    (y0, y1): (f64, f64),
    path: &Path,
) -> anyhow::Result<()> {
    for x in xs {
        chart
            .draw_series(LineSeries::new([(x, y0), (x, y1)], grid(0.12)))
            .map_err(err(path))?;
    }
    Ok(())
}
