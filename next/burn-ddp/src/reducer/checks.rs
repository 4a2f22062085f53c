//! The steps after the all-reduce, one implementation for host and device buckets: the
//! NaN/infinity verdict and clipping by the global 2-norm. The buckets' paths only produce the
//! inputs (whether a reduced value is not finite, and the sum of squares of the reduced values);
//! the decision is taken here, from values that are the same on every rank, so every rank takes
//! the same one.

use super::options::ReduceOptions;

/// What the reduced gradients of one step look like, summed over their buckets in bucket order.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Observed {
    /// A reduced value is NaN or infinite.
    pub non_finite: bool,
    /// The sum of the squares of the reduced values, in `f64` (gathered only when clipping).
    pub sum_of_squares: f64,
}

/// What to do with the step's reduced gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Verdict {
    /// Skip the step (or report it): some reduced value is not finite (with `check_finite`).
    pub non_finite: bool,
    /// The global 2-norm before clipping, when clipping is on.
    pub norm: Option<f64>,
    /// The factor every gradient is multiplied by: `max_norm / (norm + 1e-6)` when that is below
    /// 1 (`torch.nn.utils.clip_grad_norm_`'s formula), else 1.
    pub scale: f32,
}

impl Verdict {
    /// The verdict on `observed` under `options`.
    pub fn of(observed: Observed, options: &ReduceOptions) -> Self {
        let mut verdict = Verdict {
            non_finite: options.check_finite && observed.non_finite,
            norm: None,
            scale: 1.0,
        };
        if verdict.non_finite {
            return verdict;
        }
        if let Some(max_norm) = options.clip_norm {
            let norm = observed.sum_of_squares.sqrt();
            verdict.norm = Some(norm);
            let coefficient = f64::from(max_norm) / (norm + 1e-6);
            if coefficient < 1.0 {
                verdict.scale = coefficient as f32;
            }
        }
        verdict
    }

    /// The clipping factor, when the gradients were clipped.
    pub fn clip_scale(&self) -> Option<f32> {
        (self.scale != 1.0).then_some(self.scale)
    }
}

/// [`Observed`] of host values: exact, in `f64`, in the order given.
pub(crate) fn observe_host<'a>(
    buckets: impl Iterator<Item = &'a [f32]>,
    options: &ReduceOptions,
) -> Observed {
    let mut observed = Observed::default();
    for values in buckets {
        if options.check_finite {
            observed.non_finite |= values.iter().any(|v| !v.is_finite());
        }
        if options.clip_norm.is_some() {
            observed.sum_of_squares += values
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>();
        }
    }
    observed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_follows_the_torch_formula_and_non_finite_wins() {
        let options = ReduceOptions {
            clip_norm: Some(1.0),
            check_finite: true,
            ..ReduceOptions::default()
        };
        let observed = observe_host([&[3.0f32][..], &[4.0][..]].into_iter(), &options);
        assert_eq!(observed.sum_of_squares, 25.0);
        let verdict = Verdict::of(observed, &options);
        assert_eq!(verdict.norm, Some(5.0));
        assert_eq!(verdict.clip_scale(), Some((1.0 / (5.0 + 1e-6)) as f32));
        let loose = ReduceOptions {
            clip_norm: Some(10.0),
            ..options.clone()
        };
        assert_eq!(Verdict::of(observed, &loose).clip_scale(), None);
        let nan = observe_host([&[f32::NAN, 1.0][..]].into_iter(), &options);
        let verdict = Verdict::of(nan, &options);
        assert!(verdict.non_finite);
        assert_eq!(verdict.norm, None);
        // Without the check a NaN is not a verdict.
        let unchecked = ReduceOptions {
            check_finite: false,
            clip_norm: None,
            ..options
        };
        assert!(!Verdict::of(nan, &unchecked).non_finite);
    }
}
