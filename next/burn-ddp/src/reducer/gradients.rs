//! Gradients in and out of buckets: taking a parameter's gradient out of burn's
//! `GradientsParams` as a flat tensor, and registering a flat tensor back with its shape; and
//! how a bucket's gradients move between the device and host memory ([`Transfer`], used by the
//! host buckets and the reduce-scatter).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use super::layout::{Bucket, BucketLayout};
use super::link::Link;
use super::options::Control;
use crate::error::Result;
use crate::replica::TensorSpec;

/// Per bucket, per parameter of the bucket: this rank's flattened gradient, if it has one.
pub(super) type Gradients = Vec<Vec<Option<Tensor<1>>>>;

/// What a phase reduces: its buckets, their parameters, and this rank's gradients of them.
pub(super) struct Work<'a> {
    pub layout: &'a BucketLayout,
    pub specs: &'a [TensorSpec],
    pub taken: Gradients,
    /// `layout` is the agreed one (its host buffers are reused across steps).
    pub agreed: bool,
    /// The control words, in the first bucket (the step's first phase only).
    pub control: Option<&'a Control>,
}

/// Runs `$body` with `$D` bound to the const dimension `$ndims` (1 to 8).
macro_rules! with_dims {
    ($ndims:expr, $D:ident => $body:expr, else $fallback:expr) => {
        with_dims!(@arms $ndims, $D, $body, $fallback, 1 2 3 4 5 6 7 8)
    };
    (@arms $ndims:expr, $D:ident, $body:expr, $fallback:expr, $($n:literal)*) => {
        match $ndims {
            $($n => {
                const $D: usize = $n;
                $body
            })*
            _ => $fallback,
        }
    };
}
pub(super) use with_dims;

pub(super) fn numels(specs: &[TensorSpec]) -> Vec<usize> {
    specs.iter().map(TensorSpec::numel).collect()
}

/// Whether `grads` holds a gradient for `spec`.
pub(super) fn has_gradient(grads: &GradientsParams, spec: &TensorSpec) -> bool {
    with_dims!(spec.shape.len(), D => grads.get::<D>(spec.id).is_some(), else false)
}

/// Removes `spec`'s gradient from `grads` and flattens it to one dimension.
pub(super) fn take_flat(
    grads: &mut GradientsParams,
    spec: &TensorSpec,
) -> std::result::Result<Option<Tensor<1>>, String> {
    let unsupported = || {
        format!(
            "parameter `{}` has {} dimensions; gradients of 1 to 8 dimensions are supported",
            spec.path,
            spec.shape.len()
        )
    };
    with_dims!(spec.shape.len(), D => {
        match grads.remove::<D>(spec.id) {
            None => Ok(None),
            Some(g) if g.shape().as_slice() != spec.shape.as_slice() => Err(format!(
                "gradient of `{}` has shape {:?}, the parameter has shape {:?}",
                spec.path,
                g.shape().as_slice(),
                spec.shape
            )),
            Some(g) => Ok(Some(g.reshape([spec.numel()]))),
        }
    }, else Err(unsupported()))
}

/// Registers a flat gradient under `spec`'s id with `spec`'s shape.
pub(super) fn register_shaped(grads: &mut GradientsParams, spec: &TensorSpec, flat: Tensor<1>) {
    with_dims!(spec.shape.len(), D => {
        let dims: [usize; D] = std::array::from_fn(|i| spec.shape[i]);
        grads.register::<D>(spec.id, flat.reshape(dims));
    }, else {
        // `take_flat` rejected this parameter before, so the bucket never holds it.
    })
}

/// One bucket's gradients concatenated on `device` in the bucket's order (a parameter without a
/// gradient as zeros), with one presence flag per parameter (1 or 0); `None` for a bucket
/// without values. The device buckets reduce this tensor; the host buckets read it to the host
/// in one transfer.
pub(super) fn concat_bucket(
    bucket: &Bucket,
    specs: &[TensorSpec],
    grads: Vec<Option<Tensor<1>>>,
    device: &Device,
) -> (Option<Tensor<1>>, Vec<f32>) {
    let mut parts = Vec::with_capacity(bucket.params.len());
    let mut present = Vec::with_capacity(bucket.params.len());
    for (&p, grad) in bucket.params.iter().zip(grads) {
        match grad {
            Some(grad) => {
                parts.push(grad);
                present.push(1.0f32);
            }
            None => {
                parts.push(Tensor::zeros([specs[p].numel()], device));
                present.push(0.0);
            }
        }
    }
    let values = (bucket.numel > 0).then(|| Tensor::cat(parts, 0));
    (values, present)
}

/// Slices one reduced bucket (`reduced`: its values first, on the device) back into `grads`,
/// one gradient per parameter whose flag (the next of `flags`) is positive and that `keep`
/// keeps. Returns how many were registered.
pub(super) fn slice_bucket(
    bucket: &Bucket,
    specs: &[TensorSpec],
    reduced: &Tensor<1>,
    flags: &mut impl Iterator<Item = f32>,
    keep: Option<&[bool]>,
    grads: &mut GradientsParams,
) -> usize {
    let mut registered = 0;
    for (j, &p) in bucket.params.iter().enumerate() {
        // The flag's all-reduce: positive when any rank had a gradient.
        if flags.next().is_none_or(|f| f <= 0.0) {
            continue;
        }
        let spec = &specs[p];
        if keep.is_some_and(|keep| !keep.get(spec.index).copied().unwrap_or(true)) {
            continue;
        }
        let start = bucket.offsets[j];
        let flat = reduced.clone().slice(start..start + spec.numel());
        register_shaped(grads, spec, flat);
        registered += 1;
    }
    registered
}

/// Registers `source` (reduced values of `spec`'s gradient, times `scale`) under `spec`'s id:
/// written into `data`, this rank's own gradient storage when it had one (no allocation), else
/// into a new one. Returns the error naming `rank` and `bucket` when the storage is not writable
/// as `f32`: it was readable as `f32` when the gradient was taken, and skipping it would leave
/// this rank with other gradients than its peers.
#[allow(clippy::too_many_arguments)]
pub(super) fn register_scaled(
    grads: &mut GradientsParams,
    spec: &TensorSpec,
    data: Option<burn::tensor::TensorData>,
    source: &[f32],
    scale: f32,
    device: &Device,
    rank: usize,
    bucket: usize,
) -> Result<()> {
    let mut data = data.unwrap_or_else(|| {
        burn::tensor::TensorData::new(vec![0.0f32; spec.numel()], [spec.numel()])
    });
    let target = data
        .as_mut_slice::<f32>()
        .map_err(|e| crate::error::DdpError::Bucket {
            rank,
            bucket,
            detail: format!("cannot write the reduced `{}`: {e:?}", spec.path),
        })?;
    if scale == 1.0 {
        target.copy_from_slice(source);
    } else {
        target
            .iter_mut()
            .zip(source)
            .for_each(|(t, &s)| *t = s * scale);
    }
    register_shaped(grads, spec, Tensor::<1>::from_data(data, device));
    Ok(())
}

/// Removes `specs`' gradients from `grads`, flattened, per bucket of `layout`.
///
/// # Errors
/// [`DdpError::Bucket`](crate::error::DdpError::Bucket) (after aborting the group) when a
/// gradient's shape differs from its parameter's, or it has more than 8 dimensions.
pub(super) fn take(
    link: &Link,
    grads: &mut GradientsParams,
    specs: &[TensorSpec],
    layout: &BucketLayout,
) -> Result<Gradients> {
    layout
        .buckets()
        .iter()
        .enumerate()
        .map(|(bucket_index, bucket)| {
            bucket
                .params
                .iter()
                .map(|&p| {
                    take_flat(grads, &specs[p])
                        .map_err(|detail| link.fail_bucket(bucket_index, detail))
                })
                .collect()
        })
        .collect()
}

/// Per bucket of `layout`, per parameter: no gradient (a rank that contributes nothing).
pub(super) fn none(layout: &BucketLayout) -> Gradients {
    layout
        .buckets()
        .iter()
        .map(|b| b.params.iter().map(|_| None).collect())
        .collect()
}

/// Multiplies every gradient of `module`'s parameters in `grads` by `factor` (each `ParamId`
/// once): a micro-batch's share of a step under gradient accumulation, weighed before it is
/// added to the others.
pub(crate) fn scale<M: Module>(module: &M, grads: &mut GradientsParams, factor: f32) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
        seen: std::collections::HashSet<burn::module::ParamId>,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // A shared weight's second place: its gradient is scaled already.
            if !self.seen.insert(param.id) {
                return;
            }
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads
                    .register::<D>(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    let mut scale = Scale {
        grads,
        factor,
        seen: Default::default(),
    };
    module.visit(&mut scale);
}

/// How a host bucket's gradients move between the device and the host buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Transfer {
    /// Each gradient read and written back on its own, through its own storage (Burn's CPU
    /// backends, where this allocates nothing).
    PerTensor,
    /// Each bucket concatenated on the device, read once, written back once and sliced on the
    /// device (every backend that keeps its tensors off the host).
    PerBucket,
}

impl Transfer {
    /// The transfer for tensors on `device`: per tensor on Burn's CPU backends (Flex, NdArray),
    /// per bucket on every other. Every rank decides alike (one backend per job).
    pub fn of(device: &Device) -> Self {
        if crate::replica::shares_plain_values(device) {
            Transfer::PerTensor
        } else {
            Transfer::PerBucket
        }
    }
}
