//! The chart of `kachedb-bench scale`: a PNG of four panels against the
//! block count (log x): µs per request, ms, RAM bytes per block (log y),
//! and every cost over its value at the first count, with the goal (1.5×).

use crate::scale_costs::{fmt_figure, Panel, Row, COSTS};
use plotters::prelude::*;
use plotters::style::register_font;
use std::path::Path;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const GOAL: f64 = 1.5;

/// Series colours, one per cost in [`COSTS`]'s order (cycled).
const COLOURS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(255, 152, 150),
    RGBColor(197, 176, 213),
];

/// (count, value) points of `key` over `rows`.
fn series(rows: &[Row], key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| Some((r.get("blocks")?.as_f64()?, r.get(key)?.as_f64()?)))
        .filter(|&(_, v)| v > 0.0)
        .collect()
}

/// Makes `font` (TrueType bytes) the font of the chart's text; an error if
/// it is not a TrueType font.
pub fn use_font(font: &'static [u8]) -> Res<()> {
    register_font("sans-serif", FontStyle::Normal, font).map_err(|_| "the chart's font is not a TrueType font")?;
    Ok(())
}

/// Draws the chart of `rows` to `path` (PNG), its text in the font given to [`use_font`].
pub fn draw(path: &Path, rows: &[Row], block_bytes: u64) -> Res<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let root = BitMapBackend::new(path, (1600, 1100)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(50);
    title.draw(&Text::new(
        format!("kachedb-bench scale: costs against the blocks stored ({block_bytes} B blocks)"),
        (20, 12),
        ("sans-serif", 26).into_font(),
    ))?;
    let panels = body.split_evenly((2, 2));
    let x_max = rows.iter().filter_map(|r| r["blocks"].as_f64()).fold(1.0, f64::max) * 2.0;
    let x_min = rows.iter().filter_map(|r| r["blocks"].as_f64()).fold(f64::MAX, f64::min).min(x_max) / 2.0;
    let groups = [
        (Panel::Micros, "µs per request (per evicted block for evictions)"),
        (Panel::Millis, "ms"),
        (Panel::BytesPerBlock, "daemon RAM, bytes per block"),
    ];
    for (area, (panel, caption)) in panels.iter().zip(groups) {
        let lines: Vec<(usize, Vec<(f64, f64)>)> = COSTS
            .iter()
            .enumerate()
            .filter(|(_, c)| c.panel == panel)
            .map(|(i, c)| (i, series(rows, c.key)))
            .filter(|(_, s)| !s.is_empty())
            .collect();
        let (lo, hi) = lines
            .iter()
            .flat_map(|(_, s)| s.iter().map(|p| p.1))
            .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
        // Whole decades, so that every panel has labels at both ends.
        let (lo, hi) =
            if lo > hi { (0.1, 10.0) } else { (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil())) };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((x_min..x_max).log_scale(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("blocks stored")
            .x_label_formatter(&|x| format!("{x:.0e}"))
            .y_label_formatter(&|y| fmt_figure(*y))
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, s) in lines {
            let colour = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(s.clone(), colour.stroke_width(2)))?
                .label(COSTS[i].label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
            chart.draw_series(s.into_iter().map(|p| Circle::new(p, 3, colour.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()?;
    }
    // Every cost over its value at the first count.
    let first = rows.first().ok_or("no figures to draw")?;
    let n0 = first["blocks"].as_u64().unwrap_or(0);
    let ratios: Vec<(usize, Vec<(f64, f64)>)> = COSTS
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let base = first.get(c.key)?.as_f64().filter(|b| *b > 0.0)?;
            Some((i, series(rows, c.key).into_iter().map(|(x, v)| (x, v / base)).collect::<Vec<_>>()))
        })
        .filter(|(_, s): &(usize, Vec<(f64, f64)>)| s.len() > 1)
        .collect();
    let top = ratios.iter().flat_map(|(_, s)| s.iter().map(|p| p.1)).fold(2.0, f64::max) * 1.1;
    let bottom = ratios.iter().flat_map(|(_, s)| s.iter().map(|p| p.1)).fold(0.5, f64::min) * 0.9;
    let mut chart = ChartBuilder::on(&panels[3])
        .caption(
            format!("each cost over its value at {n0} blocks (colours as beside; goal ≤ {GOAL}×)"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x_min..x_max).log_scale(), (bottom..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("blocks stored")
        .x_label_formatter(&|x| format!("{x:.0e}"))
        .y_label_formatter(&|y| format!("{}×", fmt_figure(*y)))
        .label_style(("sans-serif", 14))
        .draw()?;
    chart.draw_series(LineSeries::new(vec![(x_min, GOAL), (x_max, GOAL)], RED.stroke_width(1)))?;
    for (i, s) in ratios {
        let colour = COLOURS[i % COLOURS.len()];
        chart.draw_series(LineSeries::new(s.clone(), colour.stroke_width(2)))?;
        chart.draw_series(s.into_iter().map(|p| Circle::new(p, 3, colour.filled())))?;
    }
    root.present()?;
    Ok(())
}
