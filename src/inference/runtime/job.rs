//! Jobs: [`JobBuilder`] starts one (on a job thread, or on an engine through a
//! [`JobSink`]), and [`Job`] / [`JobHandle`] cancel and join it.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};

use crossbeam_channel::{Receiver, Sender};

use super::host::panic_message;
use super::{CancelToken, In, Inference, JobStream, ModelDevice, OutStream};
use crate::error::{LlamaError, Result};

/// A job about to be started; made by [`Inference::infer`].
#[must_use = "a job does nothing until `spawn` or `run` is called"]
pub struct JobBuilder<M: ModelDevice, I, O> {
    pub(super) inference: Inference<M, I, O>,
    pub(super) input: I,
    pub(super) devices: Option<Vec<M::Device>>,
}

impl<M, I, O> JobBuilder<M, I, O>
where
    M: ModelDevice + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    /// The devices this job may run on. The job fails (on [`Job::join`], without running
    /// the handler) with [`LlamaError::InvalidParameter`] if the model lives on none of
    /// them, or if the list is empty. Without this call, the job runs wherever the model
    /// is.
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = M::Device>) -> Self {
        self.devices = Some(devices.into_iter().collect());
        self
    }

    /// Starts the job on its own thread and returns at once.
    ///
    /// Errors (bad devices, unavailable model, handler errors and panics) are reported
    /// by [`Job::join`]; the job's stream then simply ends.
    pub fn spawn(self) -> Job<O> {
        let JobBuilder {
            inference,
            input,
            devices,
        } = self;
        let inner = &inference.inner;

        let cancel = CancelToken::new();
        let (items_tx, items_rx) = crossbeam_channel::unbounded();
        // Nothing is ever sent on `done`: its sender is dropped when the handler returns,
        // which is how the stream learns the job is over.
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        let finished = Arc::new(AtomicBool::new(false));
        let stream = JobStream {
            items: items_rx,
            done: done_rx,
            cancel: cancel.clone(),
            ended: AtomicBool::new(false),
        };
        if let Some(direct) = &inner.direct {
            return match inner.admit(devices.as_deref()) {
                Err(error) => Job {
                    stream,
                    handle: JobHandle {
                        cancel,
                        state: JobState::Failed(error),
                    },
                },
                Ok(()) => {
                    let (result_tx, result_rx) = crossbeam_channel::bounded(1);
                    let sink = JobSink {
                        items: Some(items_tx),
                        done: Some(done_tx),
                        result: Some(result_tx),
                        cancel: cancel.clone(),
                    };
                    direct(input, sink);
                    Job {
                        stream,
                        handle: JobHandle {
                            cancel,
                            state: JobState::Remote(result_rx),
                        },
                    }
                }
            };
        }
        let state = match inner.admit(devices.as_deref()) {
            Err(error) => JobState::Failed(error),
            Ok(()) => {
                let out = OutStream {
                    items: items_tx,
                    cancel: cancel.clone(),
                    finished: Arc::clone(&finished),
                };
                let handler = Arc::clone(&inner.handler);
                let model = inner.accessor.clone();
                let handler_cancel = cancel.clone();
                let body = move || {
                    let outcome = catch_unwind(AssertUnwindSafe(|| {
                        handler.handle(In(input), model, handler_cancel, out)
                    }));
                    finished.store(true, Ordering::Release);
                    drop(done_tx);
                    match outcome {
                        Ok(result) => result,
                        Err(payload) => Err(LlamaError::Runtime(format!(
                            "the job handler panicked: {}",
                            panic_message(payload)
                        ))),
                    }
                };
                let id = inner.next_job.fetch_add(1, Ordering::Relaxed);
                match thread::Builder::new()
                    .name(format!("llama-burn-job-{id}"))
                    .spawn(body)
                {
                    Ok(thread) => JobState::Running(thread),
                    // The unrun body (and with it `done_tx`) is dropped: the stream ends.
                    Err(e) => JobState::Failed(LlamaError::Runtime(format!(
                        "could not start a job thread: {e}"
                    ))),
                }
            }
        };
        // On failure `done_tx` and `items_tx` are dropped by now, so the stream is over.
        Job {
            stream,
            handle: JobHandle { cancel, state },
        }
    }

    /// Runs the job to completion on its own thread and returns everything it emitted.
    ///
    /// # Errors
    ///
    /// What [`Job::join`] would report; the items emitted before the error are dropped.
    pub fn run(self) -> Result<Vec<O>> {
        let job = self.spawn();
        let items: Vec<O> = job.stream.iter().collect();
        job.join()?;
        Ok(items)
    }
}

impl<M: ModelDevice, I, O> fmt::Debug for JobBuilder<M, I, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobBuilder")
            .field("devices", &self.devices)
            .finish_non_exhaustive()
    }
}

/// A running (or finished) job: its output stream, and a handle to cancel or join it.
///
/// Iterating a `Job` by value yields `Ok(item)` for every output, then one final `Err`
/// if the job failed:
///
/// ```
/// # use llama_burn::error::LlamaError;
/// # use llama_burn::inference::{
/// #     CancelToken, In, InferenceBuilder, ModelAccessor, ModelDevice, OutStream,
/// # };
/// # struct Toy;
/// # impl ModelDevice for Toy {
/// #     type Device = ();
/// #     fn devices(&self) -> Vec<()> { vec![()] }
/// # }
/// let inference = InferenceBuilder::new().with_model(Toy).build(
///     |In(n): In<u32>, _model: ModelAccessor<Toy>, _cancel: CancelToken, out: OutStream<u32>| {
///         for i in 0..n {
///             out.emit(i)?;
///         }
///         Err(LlamaError::Runtime("out of ideas".into()))
///     },
/// );
/// let results: Vec<Result<u32, LlamaError>> = inference.infer(2).spawn().into_iter().collect();
/// assert!(matches!(results[..], [Ok(0), Ok(1), Err(LlamaError::Runtime(_))]));
/// ```
pub struct Job<O> {
    /// The handler's outputs, in the order they were emitted. Ends when the handler
    /// returns. Dropping it cancels the job.
    pub stream: JobStream<O>,
    handle: JobHandle,
}

impl<O> Job<O> {
    /// Asks the job to stop: its handler sees the cancellation at its next
    /// [`OutStream::emit`] or [`CancelToken::is_cancelled`] check.
    pub fn cancel(&self) {
        self.handle.cancel();
    }

    /// A clone of the job's token, to cancel it from elsewhere.
    pub fn cancel_token(&self) -> CancelToken {
        self.handle.cancel_token()
    }

    /// Whether the job has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.handle.is_cancelled()
    }

    /// Whether the handler has returned (or the job failed before it started).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the handler to return and reports how it ended. Outputs not read from
    /// [`Job::stream`] are discarded (the stream stays open until the handler returns,
    /// so joining does not cancel the job).
    ///
    /// # Errors
    ///
    /// The handler's error ([`LlamaError::Cancelled`] for a cancelled job whose handler
    /// said so), [`LlamaError::Runtime`] if it panicked, or why the job could not start
    /// ([`LlamaError::InvalidParameter`] for devices the model is not on,
    /// [`LlamaError::ModelUnavailable`]).
    pub fn join(self) -> Result<()> {
        let Job { stream, handle } = self;
        let result = handle.join();
        drop(stream);
        result
    }

    /// Separates the output stream from the control handle, for example to hand the
    /// stream to a response writer while keeping the right to cancel and join.
    pub fn split(self) -> (JobStream<O>, JobHandle) {
        (self.stream, self.handle)
    }
}

impl<O> IntoIterator for Job<O> {
    type Item = Result<O>;
    type IntoIter = JobIter<O>;

    fn into_iter(self) -> JobIter<O> {
        JobIter {
            stream: self.stream,
            handle: Some(self.handle),
        }
    }
}

impl<O> fmt::Debug for Job<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("stream", &self.stream)
            .field("handle", &self.handle)
            .finish()
    }
}

/// Iterator over a [`Job`] by value: `Ok(item)`s, then `Err` once if the job failed.
pub struct JobIter<O> {
    stream: JobStream<O>,
    handle: Option<JobHandle>,
}

impl<O> Iterator for JobIter<O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Result<O>> {
        if let Some(item) = self.stream.recv() {
            return Some(Ok(item));
        }
        self.handle.take()?.join().err().map(Err)
    }
}

impl<O> fmt::Debug for JobIter<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobIter")
            .field("stream", &self.stream)
            .field("joined", &self.handle.is_none())
            .finish()
    }
}

/// Control over a job without its stream; see [`Job::split`].
pub struct JobHandle {
    cancel: CancelToken,
    state: JobState,
}

enum JobState {
    Running(JoinHandle<Result<()>>),
    /// The job runs on an engine thread, which sends its result here when it ends.
    Remote(Receiver<Result<()>>),
    /// The job never started; the handler did not run.
    Failed(LlamaError),
}

impl JobHandle {
    /// Asks the job to stop; see [`Job::cancel`].
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// A clone of the job's token.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Whether the job has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Whether the handler has returned (or the job failed before it started).
    pub fn is_finished(&self) -> bool {
        match &self.state {
            JobState::Running(thread) => thread.is_finished(),
            JobState::Remote(result) => !result.is_empty(),
            JobState::Failed(_) => true,
        }
    }

    /// Waits for the handler to return; see [`Job::join`].
    ///
    /// # Errors
    ///
    /// As [`Job::join`].
    pub fn join(self) -> Result<()> {
        match self.state {
            JobState::Running(thread) => thread.join().unwrap_or_else(|payload| {
                Err(LlamaError::Runtime(format!(
                    "the job thread panicked: {}",
                    panic_message(payload)
                )))
            }),
            JobState::Remote(result) => result
                .recv()
                .unwrap_or_else(|_| Err(LlamaError::ModelUnavailable("the engine stopped".into()))),
            JobState::Failed(error) => Err(error),
        }
    }
}

/// The sending side of a job served by an engine thread rather than a job thread: its
/// outputs, its cancellation, and its result. Dropping it without [`JobSink::finish`]
/// ends the job with [`LlamaError::ModelUnavailable`].
pub(crate) struct JobSink<O> {
    items: Option<Sender<O>>,
    /// Dropped when the job ends, which is how its stream learns that.
    done: Option<Sender<()>>,
    result: Option<Sender<Result<()>>>,
    cancel: CancelToken,
}

impl<O> JobSink<O> {
    /// Sends one output. Returns false (and cancels the job) when nobody reads them.
    pub(crate) fn emit(&self, item: O) -> bool {
        let sent = self.items.as_ref().is_some_and(|tx| tx.send(item).is_ok());
        if !sent {
            self.cancel.cancel();
        }
        sent
    }

    /// The job's cancellation token.
    pub(crate) fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// Ends the job with `result`.
    pub(crate) fn finish(mut self, result: Result<()>) {
        self.end(result);
    }

    fn end(&mut self, result: Result<()>) {
        // The result first, so a stream that sees its end can join at once.
        if let Some(tx) = self.result.take() {
            let _ = tx.send(result);
        }
        self.items = None;
        self.done = None;
    }
}

impl<O> Drop for JobSink<O> {
    fn drop(&mut self) {
        if self.result.is_some() {
            self.end(Err(LlamaError::ModelUnavailable(
                "the engine stopped before the job ended".into(),
            )));
        }
    }
}

impl<O> fmt::Debug for JobSink<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobSink")
            .field("cancelled", &self.cancel.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for JobHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobHandle")
            .field("cancelled", &self.is_cancelled())
            .field("finished", &self.is_finished())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    #[test]
    fn cancel_mid_stream_stops_the_job() {
        let inference = endless_inference();
        let job = inference.infer(()).spawn();
        let first: Vec<u32> = job.stream.iter().take(3).collect();
        assert_eq!(first, vec![0, 1, 2]);
        job.cancel();
        assert!(job.is_cancelled());
        // The stream ends (the handler stops at its next emit); items already emitted
        // may still be read.
        let rest: Vec<u32> = job.stream.iter().collect();
        assert!(
            rest.iter().copied().eq(3..3 + rest.len() as u32),
            "{rest:?}"
        );
        assert!(job.stream.is_ended());
        assert!(matches!(job.join(), Err(LlamaError::Cancelled)));
        inference.shutdown().unwrap();
    }

    #[test]
    fn cancel_from_another_thread_via_token() {
        let inference = endless_inference();
        let job = inference.infer(()).spawn();
        assert_eq!(job.stream.recv(), Some(0));
        let token = job.cancel_token();
        thread::spawn(move || token.cancel()).join().unwrap();
        for _ in job.stream.iter() {}
        assert!(matches!(job.join(), Err(LlamaError::Cancelled)));
        inference.shutdown().unwrap();
    }

    #[test]
    fn handler_errors_and_panics_reach_join() {
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |In(mode): In<u8>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                out.emit(mode)?;
                match mode {
                    0 => Ok(()),
                    1 => Err(LlamaError::invalid("mode", 1, "is not allowed")),
                    _ => panic!("handler exploded"),
                }
            },
        );
        assert_eq!(inference.infer(0).run().unwrap(), vec![0]);

        let job = inference.infer(1).spawn();
        // The stream ends whatever the result, after the items emitted before the error.
        assert_eq!(job.stream.iter().collect::<Vec<_>>(), vec![1]);
        assert!(matches!(
            job.join(),
            Err(LlamaError::InvalidParameter { name: "mode", .. })
        ));
        assert!(matches!(
            inference.infer(1).run(),
            Err(LlamaError::InvalidParameter { name: "mode", .. })
        ));

        let job = inference.infer(2).spawn();
        assert_eq!(job.stream.iter().collect::<Vec<_>>(), vec![2]);
        match job.join() {
            Err(LlamaError::Runtime(msg)) => {
                assert!(
                    msg.contains("panicked") && msg.contains("handler exploded"),
                    "{msg}"
                )
            }
            other => panic!("expected Runtime, got {other:?}"),
        }
        // The service is unaffected.
        assert_eq!(inference.infer(0).run().unwrap(), vec![0]);
        inference.shutdown().unwrap();
    }

    #[test]
    fn iterating_a_job_yields_items_then_its_error() {
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |In(fail): In<bool>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                out.emit(1)?;
                out.emit(2)?;
                if fail {
                    Err(LlamaError::Runtime("late failure".into()))
                } else {
                    Ok(())
                }
            },
        );
        let ok: Vec<Result<u8>> = inference.infer(false).spawn().into_iter().collect();
        assert!(matches!(ok[..], [Ok(1), Ok(2)]), "{ok:?}");
        let failed: Vec<Result<u8>> = inference.infer(true).spawn().into_iter().collect();
        assert!(
            matches!(failed[..], [Ok(1), Ok(2), Err(LlamaError::Runtime(_))]),
            "{failed:?}"
        );
        inference.shutdown().unwrap();
    }

    #[test]
    fn run_collects_the_stream() {
        let inference = toy_inference();
        assert_eq!(
            inference.infer((3, 4)).run().unwrap(),
            vec![3000, 3001, 3002, 3003]
        );
        assert_eq!(inference.infer((3, 0)).run().unwrap(), Vec::<u32>::new());
        inference.shutdown().unwrap();
    }
}
