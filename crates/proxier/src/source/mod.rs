//! Sources turn the outside world (a static directory, the Kubernetes API) into typed objects.
//!
//! Both emit the event stream of [`model::event`] (re-exported here): `Init(kind)`, `InitApply`
//! for every object that exists now, `InitDone(kind)` on every (re)list, then `Apply` and
//! `Delete`.

pub use model::event::*;

// The sources themselves are crate `watch`, here under their former paths.
pub use ::watch::{kube, static_dir};
