//! The Fashion-MNIST example's reusable parts: reading the dataset and the CNN, shared by the
//! `fashion-mnist` binary, the custom loop and burn-ddp's multi-process tests.

pub mod data;
pub mod model;
