//! Order statistics of a sample set: nearest-rank percentiles, min and max.

/// p50/p90/p99/min/max of a set of samples, in the samples' unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median (nearest rank).
    pub p50: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

/// The `p`-th percentile (0 < p ≤ 100) of ascending `sorted` samples by the nearest-rank
/// method: the smallest sample with at least p % of all samples at or below it. A reported
/// value is always one that was measured. `None` for no samples or `p` out of range.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Summarizes `samples` (any order; NaNs are ignored). `None` when no sample is left.
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| !v.is_nan()).collect();
    sorted.sort_by(f64::total_cmp);
    Some(Summary {
        n: sorted.len(),
        p50: percentile(&sorted, 50.0)?,
        p90: percentile(&sorted, 90.0)?,
        p99: percentile(&sorted, 99.0)?,
        min: *sorted.first()?,
        max: *sorted.last()?,
    })
}

/// First quartile, median and third quartile (nearest rank) of ascending `sorted` samples,
/// for box plots.
pub fn quartiles(sorted: &[f64]) -> Option<[f64; 3]> {
    Some([
        percentile(sorted, 25.0)?,
        percentile(sorted, 50.0)?,
        percentile(sorted, 75.0)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_one_to_one_hundred_are_the_ranks_themselves() {
        let samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();

        let s = summarize(&samples).unwrap();

        assert_eq!((s.p50, s.p90, s.p99), (50.0, 90.0, 99.0));
        assert_eq!((s.min, s.max, s.n), (1.0, 100.0, 100));
    }

    #[test]
    fn nearest_rank_picks_a_measured_sample() {
        let sorted = [10.0, 20.0, 30.0, 40.0];

        assert_eq!(percentile(&sorted, 50.0), Some(20.0));
        assert_eq!(percentile(&sorted, 90.0), Some(40.0));
        assert_eq!(percentile(&sorted, 1.0), Some(10.0));
        assert_eq!(percentile(&sorted, 100.0), Some(40.0));
    }

    #[test]
    fn one_sample_is_every_percentile() {
        let s = summarize(&[7.5]).unwrap();

        assert_eq!([s.p50, s.p90, s.p99, s.min, s.max], [7.5; 5]);
    }

    #[test]
    fn no_samples_and_bad_percentiles_give_none() {
        assert_eq!(summarize(&[]), None);
        assert_eq!(summarize(&[f64::NAN]), None);
        assert_eq!(percentile(&[1.0], 0.0), None);
        assert_eq!(percentile(&[1.0], 101.0), None);
    }

    #[test]
    fn quartiles_of_eight_samples() {
        let sorted: Vec<f64> = (1..=8).map(f64::from).collect();

        assert_eq!(quartiles(&sorted), Some([2.0, 4.0, 6.0]));
    }
}
