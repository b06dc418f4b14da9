//! The job runtime: one thread owns the model, many jobs share it.
//!
//! A model is usually neither cheap to copy nor safe to use from two threads at once, yet
//! a service has many clients. This module solves that with three pieces:
//!
//! - a **model host thread** ([`ModelHost`]) that owns the model (`M: Send` is enough, it
//!   need not be `Sync`) and runs closures against it one at a time, in the order they
//!   were submitted (first come, first served across every job);
//! - a **model accessor** ([`ModelAccessor`]) that any thread uses to submit such a
//!   closure and wait for its result;
//! - **jobs** ([`Job`]): each request runs a *handler* function on its own thread, with
//!   its input ([`In`]), an accessor, a [`CancelToken`] and an [`OutStream`] to emit
//!   results on; the caller reads those results from the job's [`JobStream`] as they are
//!   produced and finally [`Job::join`]s it.
//!
//! A handler that submits many small closures (one decoding step each, say) lets other
//! jobs' closures run in between, so concurrent requests interleave on the one model.
//!
//! ```
//! use llama_burn::error::LlamaError;
//! use llama_burn::inference::{
//!     CancelToken, In, InferenceBuilder, ModelAccessor, ModelDevice, OutStream,
//! };
//!
//! /// A stand-in for a real model: it counts the calls made to it.
//! struct Counter {
//!     calls: u64,
//! }
//!
//! impl ModelDevice for Counter {
//!     type Device = &'static str;
//!     fn devices(&self) -> Vec<&'static str> {
//!         vec!["cpu"]
//!     }
//! }
//!
//! /// Emits `n` numbers, asking the model for each one separately.
//! fn count_handler(
//!     In(n): In<u64>,
//!     model: ModelAccessor<Counter>,
//!     cancel: CancelToken,
//!     out: OutStream<u64>,
//! ) -> Result<(), LlamaError> {
//!     for _ in 0..n {
//!         cancel.check()?;
//!         let value = model.submit(|counter| {
//!             counter.calls += 1;
//!             counter.calls
//!         })?;
//!         out.emit(value)?;
//!     }
//!     Ok(())
//! }
//!
//! # fn main() -> Result<(), LlamaError> {
//! let inference = InferenceBuilder::new()
//!     .with_model(Counter { calls: 0 })
//!     .build(count_handler);
//!
//! // Stream the results of one job...
//! let job = inference.infer(3).with_devices(["cpu"]).spawn();
//! let seen: Vec<u64> = job.stream.iter().collect();
//! job.join()?;
//! assert_eq!(seen, vec![1, 2, 3]);
//!
//! // ...or run one to completion and collect them.
//! assert_eq!(inference.infer(2).run()?, vec![4, 5]);
//!
//! // The model stays inspectable from outside any job.
//! assert_eq!(inference.with_model_blocking(|counter| counter.calls)?, 5);
//! inference.shutdown()?;
//! # Ok(())
//! # }
//! ```

mod host;
mod job;
mod service;
mod stream;

pub use host::{ModelAccessor, ModelDevice, ModelHost};
pub(crate) use job::JobSink;
pub use job::{Job, JobBuilder, JobHandle, JobIter};
pub(crate) use service::DirectSubmit;
pub use service::{Handler, Inference, InferenceBuilder, NoModel};
pub use stream::{CancelToken, In, IntoIter, Iter, JobStream, OutStream};

/// What the runtime's tests share: a toy model and two handlers over it.
#[cfg(test)]
mod testkit {
    pub(super) use super::*;
    pub(super) use crate::error::Result;
    pub(super) use crossbeam_channel::{Receiver, Sender};
    pub(super) use std::time::Duration;

    /// Generous bound that only turns a would-be hang into a failure; never a timing
    /// assertion.
    pub(super) const HANG_GUARD: Duration = Duration::from_secs(60);

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct Dev(pub(super) u8);

    /// A toy model: a log of what was done to it, and a signal when it is dropped.
    pub(super) struct Toy {
        pub(super) log: Vec<(u32, u32)>,
        pub(super) dropped: Option<Sender<()>>,
        pub(super) device: Dev,
    }

    impl Toy {
        pub(super) fn new() -> Self {
            Self {
                log: Vec::new(),
                dropped: None,
                device: Dev(0),
            }
        }

        pub(super) fn with_drop_signal() -> (Self, Receiver<()>) {
            let (tx, rx) = crossbeam_channel::unbounded();
            let mut toy = Self::new();
            toy.dropped = Some(tx);
            (toy, rx)
        }
    }

    impl Drop for Toy {
        fn drop(&mut self) {
            if let Some(tx) = self.dropped.take() {
                let _ = tx.send(());
            }
        }
    }

    impl ModelDevice for Toy {
        type Device = Dev;
        fn devices(&self) -> Vec<Dev> {
            vec![self.device]
        }
    }

    /// Emits `job * 1000 + step` for `steps` steps, one model submit per step.
    pub(super) fn steps_handler(
        In((job, steps)): In<(u32, u32)>,
        model: ModelAccessor<Toy>,
        cancel: CancelToken,
        out: OutStream<u32>,
    ) -> Result<()> {
        for step in 0..steps {
            cancel.check()?;
            let value = model.submit(move |toy| {
                toy.log.push((job, step));
                job * 1000 + step
            })?;
            out.emit(value)?;
        }
        Ok(())
    }

    pub(super) fn toy_inference() -> Inference<Toy, (u32, u32), u32> {
        InferenceBuilder::new()
            .with_model(Toy::new())
            .build(steps_handler)
    }

    /// A service running [`endless_handler`] on a fresh toy model.
    pub(super) fn endless_inference() -> Inference<Toy, (), u32> {
        InferenceBuilder::new()
            .with_model(Toy::new())
            .build(endless_handler)
    }

    /// Emits 0, 1, 2, ... until told to stop (via emit failing).
    pub(super) fn endless_handler(
        _input: In<()>,
        model: ModelAccessor<Toy>,
        _cancel: CancelToken,
        out: OutStream<u32>,
    ) -> Result<()> {
        let mut i = 0;
        loop {
            model.submit(|_| ())?;
            out.emit(i)?;
            i += 1;
        }
    }
}
