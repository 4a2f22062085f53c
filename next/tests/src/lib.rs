//! Shared fixtures of burn-ddp's integration tests on Burn 0.22.1: small models, a synthetic
//! classification dataset, renderers that show nothing or record, TCP groups over loopback, and
//! one function that trains with burn-train's `Learner` either on a single device (plain Burn,
//! the reference) or with `DdpStrategy`.

mod data;
mod hooked;
mod models;
mod processes;
mod renderers;
mod run;
mod values;

pub use data::*;
pub use hooked::*;
pub use models::*;
pub use processes::*;
pub use renderers::*;
pub use run::*;
pub use values::*;
