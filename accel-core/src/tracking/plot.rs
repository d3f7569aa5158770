//! Curves of a run's metrics, drawn with plotters: one panel per metric, stacked, each with
//! its axes, ticks, labels and a legend, under the run's title; PNG or SVG by the file's
//! extension. Text is set in DejaVu Sans, embedded (no system fonts needed). `accel plot
//! metrics.jsonl` draws any run's; the main job draws its own at the end.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;

use crate::error::{Error, Result};

/// One metric over the steps it was logged at.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The metric's name.
    pub name: String,
    /// (step, value), in the order logged; non-finite values are left out.
    pub points: Vec<(f64, f64)>,
}

/// The series of a `metrics.jsonl` (one JSON object per line, with `step` and numeric
/// values), by name.
pub fn read_jsonl(path: &Path) -> Result<Vec<Series>> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let mut series: Vec<Series> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let record: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            Error::Config(format!("{} line {}: not a JSON record ({e})", path.display(), i + 1))
        })?;
        let Some(map) = record.as_object() else { continue };
        let step = map.get("step").and_then(serde_json::Value::as_f64).unwrap_or(i as f64);
        for (name, value) in map.iter().filter(|(k, _)| *k != "step") {
            let Some(v) = value.as_f64().filter(|v| v.is_finite()) else { continue };
            match series.iter_mut().find(|s| s.name == *name) {
                Some(s) => s.points.push((step, v)),
                None => series.push(Series { name: name.clone(), points: vec![(step, v)] }),
            }
        }
    }
    if series.is_empty() {
        return Err(Error::Config(format!("{} holds no numeric metrics", path.display())));
    }
    Ok(series)
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn register_fonts() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| "the embedded DejaVu Sans font could not be read".to_string())?;
        register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
            .map_err(|_| "the embedded DejaVu Sans Bold font could not be read".to_string())
    })
    .clone()
    .map_err(Error::Training)
}

/// Pixels per panel, and for the title.
const WIDTH: u32 = 800;
const PANEL: u32 = 240;
const TITLE: u32 = 40;

/// Draws `series` under `title` into `out`: `.svg` as SVG, anything else as PNG.
pub fn plot(series: &[Series], title: &str, out: &Path) -> Result<()> {
    register_fonts()?;
    if series.is_empty() {
        return Err(Error::Config("nothing to plot".into()));
    }
    let size = (WIDTH, TITLE + PANEL * series.len() as u32);
    let failed = |e: String| Error::Training(format!("drawing {}: {e}", out.display()));
    let svg = out.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if svg {
        let root = SVGBackend::new(out, size).into_drawing_area();
        draw(&root, series, title).map_err(|e| failed(e.to_string()))?;
        root.present().map_err(|e| failed(e.to_string()))
    } else {
        let root = BitMapBackend::new(out, size).into_drawing_area();
        draw(&root, series, title).map_err(|e| failed(e.to_string()))?;
        root.present().map_err(|e| failed(e.to_string()))
    }
}

/// Draws every series of `metrics.jsonl` under `title` into each of `outs`.
pub fn plot_jsonl(metrics: &Path, title: &str, outs: &[&Path]) -> Result<()> {
    let series = read_jsonl(metrics)?;
    for out in outs {
        plot(&series, title, out)?;
    }
    Ok(())
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = if hi > lo { (hi - lo) * 0.05 } else { lo.abs().max(1.0) * 0.05 };
    (lo - pad, hi + pad)
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    series: &[Series],
    title: &str,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22).into_font().style(FontStyle::Bold))?;
    let panels = root.split_evenly((series.len(), 1));
    for (i, (panel, s)) in panels.iter().zip(series).enumerate() {
        let color = COLORS[i % COLORS.len()];
        let (x0, x1) = range(s.points.iter().map(|p| p.0));
        let (y0, y1) = range(s.points.iter().map(|p| p.1));
        let mut chart = ChartBuilder::on(panel)
            .margin(12)
            .x_label_area_size(38)
            .y_label_area_size(70)
            .caption(&s.name, ("sans-serif", 16))
            .build_cartesian_2d(x0..x1, y0..y1)?;
        let whole_steps = s.points.iter().all(|p| p.0.fract() == 0.0);
        let step_label = |x: &f64| {
            if whole_steps { format!("{x:.0}") } else { format!("{x}") }
        };
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(s.name.as_str())
            .x_label_formatter(&step_label)
            .label_style(("sans-serif", 12))
            .axis_desc_style(("sans-serif", 14))
            .max_light_lines(2)
            .light_line_style(RGBColor(240, 240, 240))
            .draw()?;
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_file_becomes_a_png_and_an_svg_with_axes_labels_legend_and_title() {
        let dir = std::env::temp_dir().join(format!("accel-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let metrics = dir.join("metrics.jsonl");
        let lines: Vec<String> = (1..=20)
            .map(|s| {
                let loss = 2.0 / s as f64;
                format!(r#"{{"step":{s},"loss":{loss},"accuracy":{},"lr":null}}"#, 1.0 - loss / 3.0)
            })
            .collect();
        std::fs::write(&metrics, lines.join("\n") + "\n").unwrap();
        let series = read_jsonl(&metrics).unwrap();
        assert_eq!(
            series.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["accuracy", "loss"]
        );
        assert_eq!(series[1].points[1], (2.0, 1.0));
        let (png, svg) = (dir.join("curves.png"), dir.join("curves.svg"));
        plot_jsonl(&metrics, "a test run", &[&png, &svg]).unwrap();

        let text = std::fs::read_to_string(&svg).unwrap();
        for expected in
            ["<svg", "a test run", ">\nstep\n<", ">\nloss\n<", ">\naccuracy\n<", "<polyline"]
        {
            assert!(text.contains(expected), "{expected} missing from the SVG");
        }
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        assert_eq!((info.width, info.height), (WIDTH, TITLE + 2 * PANEL));
        // Lines in the first two colours, and dark text, on white.
        let rgb: Vec<&[u8]> = pixels.chunks(info.line_size / info.width as usize).collect();
        for colour in [[31u8, 119, 180], [255, 127, 14]] {
            assert!(rgb.iter().filter(|p| p[..3] == colour).count() > 100, "{colour:?}");
        }
        assert!(rgb.iter().filter(|p| p[0] < 60 && p[1] < 60 && p[2] < 60).count() > 500);
        let _ = std::fs::remove_dir_all(dir);
    }
}
