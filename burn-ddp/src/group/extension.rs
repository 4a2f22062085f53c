//! The collectives beyond [`ProcessGroup`]'s: the 16-bit all-reduce of gradient compression and
//! the all-reduce of device tensors (NCCL). The crate's own groups run them natively (they
//! implement [`Native`], which is sealed: another crate can name it, to forward a wrapped
//! group's, but not implement it); for any other group,
//! [`ExtendedCollectives`] falls back to the `f32` all-reduce and to host buckets. So the trait a
//! user implements stays small, and a user's group still works with compression (without the
//! saving on the wire).

use std::any::Any;
use std::time::Duration;

use super::collective::{HalfFloat, ReduceOp};
use super::{ProcessGroup, reduce_widened};
use crate::error::Result;

/// Keeps [`Native`] to the crate's own groups.
mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// The extended collectives of burn-ddp's own process groups (sealed: implemented by them only).
/// A group of yours that wraps one of them forwards its
/// [`native`](ProcessGroup::native): `fn native(&self) -> Option<&dyn Native> {
/// self.inner.native() }`.
pub trait Native: ProcessGroup + Sealed {
    /// As [`ExtendedCollectives::all_reduce_half`]; by default widened to `f32`.
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        reduce_widened(bucket, format, |wide| self.all_reduce(wide, op, timeout))
    }

    /// As [`ExtendedCollectives::reduces_device_tensors`].
    fn reduces_device_tensors(&self) -> bool {
        false
    }

    /// As [`ExtendedCollectives::all_reduce_device`].
    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        let _ = (tensor, op, timeout);
        Ok(false)
    }
}

/// The collectives the reducer and the communication hooks run beyond [`ProcessGroup`]'s, on any
/// process group: natively on the crate's own groups, by the fallback given for each method on
/// any other.
pub trait ExtendedCollectives {
    /// Reduces `bucket`, 16-bit floats in `format` (their bits), across ranks in place: every
    /// rank gets the element-wise sum (or average) of all ranks' values, rounded to `format`,
    /// bit-identical on every rank. For gradient compression: a group that moves bytes sends half
    /// of them ([`TcpGroup`](super::TcpGroup) sends the 16-bit values, adding in `f32` and
    /// rounding at every hop). Fallback: widens to `f32`, runs
    /// [`all_reduce`](ProcessGroup::all_reduce) and rounds once (no saving on the wire).
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce).
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;

    /// Whether [`all_reduce_device`](Self::all_reduce_device) takes device tensors; the
    /// [`Reducer`](crate::mechanism::Reducer) then builds its buckets in device memory instead
    /// of host buffers. Fallback: `false`.
    fn reduces_device_tensors(&self) -> bool;

    /// Reduces `tensor`, a flat bucket in device memory, in place, like
    /// [`all_reduce`](ProcessGroup::all_reduce). `tensor` is the backend's float tensor primitive
    /// (`B::FloatTensorPrimitive`, e.g. a `CubeTensor` or a `FusionTensor` of burn-cuda) of
    /// shape `[len]`, the same `len` and dtype on every rank.
    ///
    /// Returns `Ok(false)`, without communicating, when the group cannot reduce that kind of
    /// tensor (the fallback for any tensor).
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce); [`Nccl`](crate::DdpError::Nccl) for a failed
    /// NCCL or CUDA call or a buffer that does not fit (not contiguous, unsupported dtype).
    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool>;
}

impl<G: ProcessGroup + ?Sized> ExtendedCollectives for G {
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        match self.native() {
            Some(native) => native.all_reduce_half(bucket, format, op, timeout),
            None => reduce_widened(bucket, format, |wide| self.all_reduce(wide, op, timeout)),
        }
    }

    fn reduces_device_tensors(&self) -> bool {
        self.native().is_some_and(Native::reduces_device_tensors)
    }

    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        match self.native() {
            Some(native) => native.all_reduce_device(tensor, op, timeout),
            None => Ok(false),
        }
    }
}
