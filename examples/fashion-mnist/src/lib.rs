//! The Fashion-MNIST example's reusable parts: reading the dataset and the CNN, shared by the
//! `fashion-mnist` binary and burn-ddp's multi-process tests.

pub mod data;
#[cfg(feature = "wgpu")]
pub mod devices;
pub mod model;
