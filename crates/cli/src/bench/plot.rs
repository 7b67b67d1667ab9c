//! `bulkhead bench --plot FILE.svg`: the distribution of every step and of the end-to-end time,
//! one panel each (the steps differ by orders of magnitude, so each panel has its own ms
//! axis): a box from the first to the third quartile with the median, whiskers to the min and
//! max, and every run as a dot.

use std::path::Path;

use plotters::prelude::*;

use super::report::Series;
use super::stats::quartiles;

/// Height of one panel, pixels.
const PANEL: u32 = 110;
/// Width of the picture, pixels.
const WIDTH: u32 = 900;
/// Height of the title band, pixels.
const TITLE: u32 = 40;

/// Draws `series` under `title` into the SVG file `path`.
///
/// # Errors
/// A one-line message when drawing or writing the file fails.
pub fn write_svg(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let fail = |e: String| format!("cannot draw the plot {}: {e}", path.display());
    let height = TITLE + PANEL * series.len().max(1) as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let (head, body) = root.split_vertically(TITLE);
    head.draw_text(
        title,
        &("sans-serif", 20).into_font().color(&BLACK),
        (10, 10),
    )
    .map_err(|e| fail(e.to_string()))?;
    let panels = body.split_evenly((series.len().max(1), 1));
    for (panel, s) in panels.iter().zip(series) {
        draw_panel(panel, s).map_err(fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

/// One series' panel.
fn draw_panel(
    panel: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    s: &Series,
) -> Result<(), String> {
    let mut sorted: Vec<f64> = s.values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let (Some(&min), Some(&max), Some([q1, median, q3])) =
        (sorted.first(), sorted.last(), quartiles(&sorted))
    else {
        let caption = format!("{} (ms): no data", s.label);
        return panel
            .draw_text(
                &caption,
                &("sans-serif", 15).into_font().color(&BLACK),
                (10, 10),
            )
            .map_err(|e| e.to_string());
    };
    let pad = ((max - min) * 0.05).max(0.05);
    let mut chart = ChartBuilder::on(panel)
        .caption(format!("{} (ms)", s.label), ("sans-serif", 15))
        .margin(6)
        .margin_left(20)
        .margin_right(20)
        .x_label_area_size(22)
        .build_cartesian_2d((min - pad).max(0.0)..(max + pad), 0f64..1f64)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_axis()
        .disable_y_mesh()
        .x_labels(10)
        .x_label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| e.to_string())?;
    let blue = RGBColor(40, 90, 170);
    let elements: Vec<DynElement<'_, SVGBackend<'_>, (f64, f64)>> = vec![
        Rectangle::new([(q1, 0.3), (q3, 0.7)], blue.mix(0.25).filled()).into_dyn(),
        Rectangle::new([(q1, 0.3), (q3, 0.7)], blue.stroke_width(1)).into_dyn(),
        PathElement::new(vec![(median, 0.25), (median, 0.75)], blue.stroke_width(3)).into_dyn(),
        PathElement::new(vec![(min, 0.5), (q1, 0.5)], blue.stroke_width(1)).into_dyn(),
        PathElement::new(vec![(q3, 0.5), (max, 0.5)], blue.stroke_width(1)).into_dyn(),
    ];
    chart.draw_series(elements).map_err(|e| e.to_string())?;
    let dots = s
        .values
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| Circle::new((v, jitter(i)), 2, BLACK.mix(0.6).filled()));
    chart.draw_series(dots).map_err(|e| e.to_string())?;
    Ok(())
}

/// A vertical position in 0.15..0.85 for dot `i`, spread by the golden ratio so dots of equal
/// values stay apart, and the same on every run of the bench.
fn jitter(i: usize) -> f64 {
    let frac = (i as f64 * 0.618_033_988_75).fract();
    0.15 + 0.7 * frac
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_svg_is_written_with_every_series_name() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.svg");
        let series = vec![
            Series {
                label: "kernel_entry → guest_init".into(),
                values: vec![10.0, 12.0, 11.0, 30.0],
            },
            Series {
                label: "agent_ready → first_output".into(),
                values: vec![1.5],
            },
            Series {
                label: "vm_created → memory_ready".into(),
                values: vec![],
            },
        ];

        // Act
        write_svg(&path, "bulkhead bench <test>", &series).unwrap();

        // Assert
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        for s in &series {
            assert!(svg.contains(&s.label), "{} missing", s.label);
        }
        assert!(svg.contains("<circle"), "no dots drawn");
        assert!(
            svg.contains("bulkhead bench &lt;test&gt;"),
            "title not escaped"
        );
    }

    #[test]
    fn an_unwritable_path_is_an_error_naming_it() {
        let err = write_svg(Path::new("/nonexistent/dir/p.svg"), "t", &[]).unwrap_err();

        assert!(err.contains("/nonexistent/dir/p.svg"), "{err}");
    }

    #[test]
    fn jitter_stays_inside_the_panel() {
        assert!((0..1000).map(jitter).all(|y| (0.15..0.85).contains(&y)));
    }
}
