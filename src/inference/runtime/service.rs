//! The inference service: [`InferenceBuilder`] starts the model thread and [`Inference`]
//! hands each job to a [`Handler`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use super::host::join_model_thread;
use super::{
    CancelToken, In, JobBuilder, JobSink, ModelAccessor, ModelDevice, ModelHost, OutStream,
};
use crate::error::{LlamaError, Result};

/// What a job runs: a function of the job's input, a model accessor, a cancellation token
/// and an output stream.
///
/// Implemented for every `Fn(In<I>, ModelAccessor<M>, CancelToken, OutStream<O>) ->
/// Result<(), LlamaError>` that is `Send + Sync + 'static`, generic functions included
/// (their type parameters are inferred from the model type). Implement it by hand for a
/// handler that is a struct, and pass it to [`InferenceBuilder::build_handler`].
pub trait Handler<M, I, O>: Send + Sync + 'static {
    /// Serves one job. Return `Err(LlamaError::Cancelled)` when stopping because of
    /// cancellation; the error (or `Ok`) is what [`Job::join`](super::Job::join) reports.
    ///
    /// # Errors
    ///
    /// Whatever the handler decides; it reaches [`Job::join`](super::Job::join) unchanged.
    fn handle(
        &self,
        input: In<I>,
        model: ModelAccessor<M>,
        cancel: CancelToken,
        out: OutStream<O>,
    ) -> Result<()>;
}

impl<M, I, O, F> Handler<M, I, O> for F
where
    F: Fn(In<I>, ModelAccessor<M>, CancelToken, OutStream<O>) -> Result<()> + Send + Sync + 'static,
{
    fn handle(
        &self,
        input: In<I>,
        model: ModelAccessor<M>,
        cancel: CancelToken,
        out: OutStream<O>,
    ) -> Result<()> {
        self(input, model, cancel, out)
    }
}

/// The model slot of an [`InferenceBuilder`] before [`InferenceBuilder::with_model`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoModel;

/// Sets up an [`Inference`] service: `InferenceBuilder::new().with_model(m).build(h)`.
///
/// See the [module documentation](crate::inference::runtime) for a complete example.
#[must_use = "an InferenceBuilder does nothing until `build` is called"]
pub struct InferenceBuilder<M = NoModel> {
    model: M,
}

impl InferenceBuilder<NoModel> {
    /// A builder without a model yet.
    pub fn new() -> Self {
        Self { model: NoModel }
    }
}

impl Default for InferenceBuilder<NoModel> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> InferenceBuilder<M> {
    /// The model to serve. It will be moved onto its own thread by `build`.
    pub fn with_model<N>(self, model: N) -> InferenceBuilder<N> {
        InferenceBuilder { model }
    }

    /// Takes the model back out of the builder (for builders that wrap it first).
    pub(crate) fn into_model(self) -> M {
        self.model
    }
}

impl<M: ModelDevice + Send + 'static> InferenceBuilder<M> {
    /// Starts the model thread, reads the model's devices on it, and returns the service
    /// that runs `handler` for every job.
    ///
    /// `handler` is typically a plain function
    /// `fn(In<I>, ModelAccessor<M>, CancelToken, OutStream<O>) -> Result<(), LlamaError>`
    /// (a generic one is fine: its type parameters are inferred from `M`) or a closure.
    ///
    /// Never fails: if the model thread cannot be started, or reading the model's devices
    /// panics, every job of the returned service fails with
    /// [`LlamaError::ModelUnavailable`].
    pub fn build<I, O, H>(self, handler: H) -> Inference<M, I, O>
    where
        H: Fn(In<I>, ModelAccessor<M>, CancelToken, OutStream<O>) -> Result<()>
            + Send
            + Sync
            + 'static,
        I: Send + 'static,
        O: Send + 'static,
    {
        self.build_handler(handler)
    }

    /// Like [`InferenceBuilder::build`], for any [`Handler`] implementation (for example
    /// a struct carrying configuration).
    pub fn build_handler<I, O, H>(self, handler: H) -> Inference<M, I, O>
    where
        H: Handler<M, I, O>,
        I: Send + 'static,
        O: Send + 'static,
    {
        self.build_with(handler, None)
    }

    /// Builds the service with an optional direct submitter used instead of job threads.
    pub(crate) fn build_with<I, O, H>(
        self,
        handler: H,
        direct: Option<DirectSubmit<I, O>>,
    ) -> Inference<M, I, O>
    where
        H: Handler<M, I, O>,
        I: Send + 'static,
        O: Send + 'static,
    {
        let (accessor, thread, devices) = match ModelHost::spawn(self.model) {
            Ok(host) => {
                let ModelHost { accessor, thread } = host;
                let devices = accessor
                    .submit(|model: &mut M| model.devices())
                    .map_err(|e| format!("could not read the model's devices: {e}"));
                (accessor, Some(thread), devices)
            }
            Err(e) => (ModelAccessor::closed(), None, Err(e.to_string())),
        };
        Inference {
            inner: Arc::new(Inner {
                accessor,
                thread,
                devices,
                handler: Arc::new(handler),
                direct,
                next_job: AtomicU64::new(0),
                _io: PhantomData,
            }),
        }
    }
}

impl<M> fmt::Debug for InferenceBuilder<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InferenceBuilder").finish_non_exhaustive()
    }
}

/// A running inference service: one model on its own thread, and a handler that serves
/// jobs of input `I` and output `O` against it.
///
/// Cheap to clone (an `Arc` inside) and `Send + Sync`, so any number of threads can call
/// [`Inference::infer`] at once. The model thread stops, dropping the model, once every
/// clone is dropped (or shut down) and every job has finished.
pub struct Inference<M: ModelDevice, I, O> {
    pub(super) inner: Arc<Inner<M, I, O>>,
}

pub(super) struct Inner<M: ModelDevice, I, O> {
    pub(super) accessor: ModelAccessor<M>,
    /// `None` if the model thread could not be started.
    pub(super) thread: Option<JoinHandle<M>>,
    /// The model's devices, or why the model cannot be used.
    pub(super) devices: std::result::Result<Vec<M::Device>, String>,
    pub(super) handler: Arc<dyn Handler<M, I, O>>,
    /// Where jobs go instead of a job thread, for services whose work runs on an engine
    /// thread of its own (continuous batching).
    pub(super) direct: Option<DirectSubmit<I, O>>,
    pub(super) next_job: AtomicU64,
    pub(super) _io: PhantomData<fn(I) -> O>,
}

/// Hands a job's input and its sending side to an engine.
pub(crate) type DirectSubmit<I, O> = Arc<dyn Fn(I, JobSink<O>) + Send + Sync>;

impl<M: ModelDevice, I, O> Clone for Inference<M, I, O> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<M, I, O> Inference<M, I, O>
where
    M: ModelDevice + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    /// Prepares a job for `input`; call [`JobBuilder::spawn`] or [`JobBuilder::run`] on
    /// the result.
    pub fn infer(&self, input: I) -> JobBuilder<M, I, O> {
        JobBuilder {
            inference: self.clone(),
            input,
            devices: None,
        }
    }

    /// Runs `f` on the model thread, in turn with the jobs' closures, and returns its
    /// result; the same as [`ModelAccessor::submit`] from outside a job.
    ///
    /// # Errors
    ///
    /// As [`ModelAccessor::submit`].
    pub fn with_model_blocking<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut M) -> R + Send + 'static,
        R: Send + 'static,
    {
        self.inner.accessor.submit(f)
    }

    /// A new accessor to the served model, for work outside the handler (a batching
    /// engine, say). It keeps the model thread alive until dropped.
    pub fn model_accessor(&self) -> ModelAccessor<M> {
        self.inner.accessor.clone()
    }

    /// The devices the model lives on, as read when the service was built (empty if the
    /// model is unavailable).
    pub fn devices(&self) -> &[M::Device] {
        self.inner.devices.as_deref().unwrap_or(&[])
    }

    /// Drops this handle and, if it was the last clone, waits for the model thread to
    /// stop: it does so once every job has finished and every [`ModelAccessor`] obtained
    /// from [`Inference::model_accessor`] is dropped, so don't call it from a handler or
    /// while holding an accessor. If other clones exist, returns at once.
    ///
    /// Simply dropping every clone also stops the thread, without waiting for it.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if dropping the model panicked, or if called on the model
    /// thread.
    pub fn shutdown(self) -> Result<()> {
        let Ok(inner) = Arc::try_unwrap(self.inner) else {
            return Ok(());
        };
        match inner.release() {
            Some(thread) => join_model_thread(thread).map(drop),
            None => Ok(()),
        }
    }

    /// Like [`Inference::shutdown`], but hands the model back once its thread stops (for
    /// example to serve it another way). Fails if other clones of the service exist or
    /// the model thread is gone.
    pub fn into_model(self) -> Result<M> {
        let inner = Arc::try_unwrap(self.inner).map_err(|_| {
            LlamaError::Runtime("other clones of this inference service are still alive".into())
        })?;
        let thread = inner
            .release()
            .ok_or_else(|| LlamaError::ModelUnavailable("the model thread never started".into()))?;
        join_model_thread(thread)
    }
}

impl<M: ModelDevice, I, O> Inner<M, I, O> {
    /// Releases everything that could hold the model thread open (the accessor, the
    /// handler) and returns the thread to wait on.
    fn release(self) -> Option<JoinHandle<M>> {
        let Inner {
            accessor,
            thread,
            devices,
            handler,
            direct,
            next_job: _,
            _io,
        } = self;
        drop(direct);
        drop(accessor);
        drop(handler);
        drop(devices);
        thread
    }
}

impl<M: ModelDevice, I, O> Inner<M, I, O> {
    /// Checks that a job may run: the model is usable and on one of the requested devices.
    pub(super) fn admit(&self, requested: Option<&[M::Device]>) -> Result<()> {
        let model_devices = match &self.devices {
            Ok(devices) => devices,
            Err(why) => return Err(LlamaError::ModelUnavailable(why.clone())),
        };
        let Some(requested) = requested else {
            return Ok(());
        };
        if requested.is_empty() {
            return Err(LlamaError::invalid(
                "devices",
                "[]",
                "at least one device is required (omit `with_devices` for the model's own)",
            ));
        }
        if requested
            .iter()
            .any(|device| model_devices.contains(device))
        {
            Ok(())
        } else {
            Err(LlamaError::InvalidParameter {
                name: "devices",
                value: format!("{requested:?} (the model is on {model_devices:?})"),
                reason: "the model does not live on any of the requested devices",
            })
        }
    }
}

impl<M: ModelDevice, I, O> fmt::Debug for Inference<M, I, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inference")
            .field("devices", &self.inner.devices)
            .field("jobs_started", &self.inner.next_job.load(Ordering::Relaxed))
            .field("queued", &self.inner.accessor.queued())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use std::sync::Barrier;
    use std::sync::atomic::AtomicUsize;
    use std::thread;

    #[test]
    fn public_types_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        /// Send but not Sync, like many models.
        struct NotSync(std::cell::Cell<u32>);
        impl ModelDevice for NotSync {
            type Device = ();
            fn devices(&self) -> Vec<()> {
                vec![()]
            }
        }
        send_sync::<Inference<NotSync, String, String>>();
        send_sync::<ModelAccessor<NotSync>>();
        send_sync::<ModelHost<NotSync>>();
        send_sync::<CancelToken>();
        send_sync::<OutStream<String>>();
        send_sync::<JobStream<String>>();
        send_sync::<Job<String>>();
        send_sync::<JobHandle>();
        send::<JobBuilder<NotSync, String, String>>();
        let _ = NotSync(std::cell::Cell::new(0)).0.get();
    }

    #[test]
    fn generic_fn_handlers_infer_their_parameters_from_the_model() {
        struct Generic<B, T>(PhantomData<(B, T)>);
        impl<B, T> ModelDevice for Generic<B, T> {
            type Device = ();
            fn devices(&self) -> Vec<()> {
                vec![()]
            }
        }
        fn generic_handler<B: Send + 'static, T: Send + 'static>(
            In(text): In<String>,
            model: ModelAccessor<Generic<B, T>>,
            _cancel: CancelToken,
            out: OutStream<usize>,
        ) -> Result<(), LlamaError> {
            let len = model.submit(move |_m| text.len())?;
            out.emit(len)
        }
        let inference = InferenceBuilder::new()
            .with_model(Generic::<u8, i64>(PhantomData))
            .build(generic_handler);
        assert_eq!(inference.infer("four".into()).run().unwrap(), vec![4]);
        inference.shutdown().unwrap();
    }

    #[test]
    fn closures_need_no_annotations_and_structs_can_be_handlers() {
        // Parameter types of a closure come from `build`'s signature.
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |In(n): In<u32>, model, _cancel, out| {
                let len = model.submit(|toy: &mut Toy| toy.log.len())?;
                out.emit(n + len as u32)
            },
        );
        assert_eq!(inference.infer(5).run().unwrap(), vec![5]);
        inference.shutdown().unwrap();

        struct Repeat {
            times: usize,
        }
        impl Handler<Toy, String, String> for Repeat {
            fn handle(
                &self,
                In(text): In<String>,
                _model: ModelAccessor<Toy>,
                _cancel: CancelToken,
                out: OutStream<String>,
            ) -> Result<()> {
                for _ in 0..self.times {
                    out.emit(text.clone())?;
                }
                Ok(())
            }
        }
        let inference = InferenceBuilder::new()
            .with_model(Toy::new())
            .build_handler(Repeat { times: 2 });
        assert_eq!(
            inference.infer("hi".into()).run().unwrap(),
            vec!["hi".to_string(), "hi".to_string()]
        );
        inference.shutdown().unwrap();
    }

    #[test]
    fn sixty_four_jobs_at_once_all_complete_with_their_own_outputs() {
        const JOBS: u32 = 64;
        // Every handler waits at this barrier, so the test only passes if all 64 run at
        // the same time (a small bounded pool would deadlock here).
        let barrier = Arc::new(Barrier::new(JOBS as usize));
        let handler_barrier = Arc::clone(&barrier);
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            move |input: In<(u32, u32)>,
                  model: ModelAccessor<Toy>,
                  cancel: CancelToken,
                  out: OutStream<u32>| {
                handler_barrier.wait();
                steps_handler(input, model, cancel, out)
            },
        );
        let jobs: Vec<_> = (0..JOBS).map(|j| inference.infer((j, 5)).spawn()).collect();
        for (j, job) in jobs.into_iter().enumerate() {
            let j = j as u32;
            let outs: Vec<u32> = job.stream.iter().collect();
            assert_eq!(outs, (0..5).map(|s| j * 1000 + s).collect::<Vec<_>>());
            job.join().unwrap();
        }
        let log = inference.with_model_blocking(|toy| toy.log.len()).unwrap();
        assert_eq!(log, JOBS as usize * 5);
        inference.shutdown().unwrap();
    }

    #[test]
    fn jobs_submitting_small_steps_interleave() {
        // Input: (job id, steps, gate). Job A pauses after its first step until the test
        // has seen job B's first output; if one job held the model for its whole run, B
        // could never produce that output.
        type Input = (u32, u32, Option<Receiver<()>>);
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |In((job, steps, gate)): In<Input>,
             model: ModelAccessor<Toy>,
             _cancel: CancelToken,
             out: OutStream<u32>| {
                for step in 0..steps {
                    model.submit(move |toy| toy.log.push((job, step)))?;
                    out.emit(step)?;
                    if step == 0
                        && let Some(gate) = &gate
                    {
                        gate.recv()
                            .map_err(|_| LlamaError::Runtime("gate closed".into()))?;
                    }
                }
                Ok(())
            },
        );
        let (release_a, gate_a) = crossbeam_channel::bounded(1);
        let job_a = inference.infer((1, 20, Some(gate_a))).spawn();
        assert_eq!(job_a.stream.recv_timeout(HANG_GUARD), Ok(0));
        let job_b = inference.infer((2, 20, None)).spawn();
        assert_eq!(job_b.stream.recv_timeout(HANG_GUARD), Ok(0));
        assert!(!job_a.is_finished());
        release_a.send(()).unwrap();
        let rest_a: Vec<u32> = job_a.stream.iter().collect();
        let rest_b: Vec<u32> = job_b.stream.iter().collect();
        assert_eq!(rest_a, (1..20).collect::<Vec<_>>());
        assert_eq!(rest_b, (1..20).collect::<Vec<_>>());
        job_a.join().unwrap();
        job_b.join().unwrap();

        let log = inference
            .with_model_blocking(|toy| toy.log.clone())
            .unwrap();
        let pos = |entry| log.iter().position(|e| *e == entry).unwrap();
        assert!(pos((2, 0)) < pos((1, 19)), "{log:?}");
        // Each job's own steps stay in order.
        for job in [1, 2] {
            let steps: Vec<u32> = log.iter().filter(|e| e.0 == job).map(|e| e.1).collect();
            assert_eq!(steps, (0..20).collect::<Vec<_>>());
        }
        inference.shutdown().unwrap();
    }

    #[test]
    fn free_running_jobs_both_finish() {
        let inference = toy_inference();
        let a = inference.infer((1, 50)).spawn();
        let b = inference.infer((2, 50)).spawn();
        let outs_b: Vec<u32> = b.stream.iter().collect();
        let outs_a: Vec<u32> = a.stream.iter().collect();
        assert_eq!(outs_a, (1000..1050).collect::<Vec<_>>());
        assert_eq!(outs_b, (2000..2050).collect::<Vec<_>>());
        a.join().unwrap();
        b.join().unwrap();
        inference.shutdown().unwrap();
    }

    #[test]
    fn model_is_dropped_after_shutdown() {
        let (toy, dropped) = Toy::with_drop_signal();
        let inference = InferenceBuilder::new().with_model(toy).build(steps_handler);
        let clone = inference.clone();
        assert_eq!(clone.infer((1, 1)).run().unwrap(), vec![1000]);
        // Not the last clone: returns at once, model still there.
        clone.shutdown().unwrap();
        assert_eq!(
            dropped.try_recv(),
            Err(crossbeam_channel::TryRecvError::Empty)
        );
        assert_eq!(inference.infer((1, 1)).run().unwrap(), vec![1000]);
        inference.shutdown().unwrap();
        // The last shutdown waited for the model thread, which dropped the model.
        assert_eq!(dropped.try_recv(), Ok(()));
    }

    #[test]
    fn running_jobs_outlive_the_inference_and_then_the_model_is_dropped() {
        let (toy, dropped) = Toy::with_drop_signal();
        type Input = Receiver<()>;
        let inference = InferenceBuilder::new().with_model(toy).build(
            |In(gate): In<Input>,
             model: ModelAccessor<Toy>,
             _c: CancelToken,
             out: OutStream<usize>| {
                gate.recv().ok();
                out.emit(model.submit(|toy| toy.log.len())?)
            },
        );
        let (open, gate) = crossbeam_channel::bounded(1);
        let job = inference.infer(gate).spawn();
        drop(inference);
        assert_eq!(
            dropped.try_recv(),
            Err(crossbeam_channel::TryRecvError::Empty)
        );
        open.send(()).unwrap();
        assert_eq!(job.stream.iter().collect::<Vec<_>>(), vec![0]);
        job.join().unwrap();
        // The last accessor went with the job: the model thread stops and drops it.
        assert_eq!(dropped.recv_timeout(HANG_GUARD), Ok(()));
    }

    #[test]
    fn unavailable_model_fails_every_job() {
        struct BadDevices;
        impl ModelDevice for BadDevices {
            type Device = ();
            fn devices(&self) -> Vec<()> {
                panic!("no devices here")
            }
        }
        let inference = InferenceBuilder::new().with_model(BadDevices).build(
            |_i: In<()>, _m: ModelAccessor<BadDevices>, _c: CancelToken, out: OutStream<u8>| {
                out.emit(1)
            },
        );
        assert!(inference.devices().is_empty());
        match inference.infer(()).run() {
            Err(LlamaError::ModelUnavailable(msg)) => {
                assert!(msg.contains("no devices here"), "{msg}")
            }
            other => panic!("expected ModelUnavailable, got {other:?}"),
        }
        inference.shutdown().unwrap();
    }

    #[test]
    fn many_threads_share_one_inference() {
        let inference = toy_inference();
        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let inference = inference.clone();
                thread::spawn(move || {
                    (0..4u32)
                        .map(|k| inference.infer((t * 10 + k, 3)).run())
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        for (t, th) in threads.into_iter().enumerate() {
            let results = th.join().unwrap().unwrap();
            for (k, outs) in results.into_iter().enumerate() {
                let id = t as u32 * 10 + k as u32;
                assert_eq!(outs, vec![id * 1000, id * 1000 + 1, id * 1000 + 2]);
            }
        }
        inference.shutdown().unwrap();
    }

    #[test]
    fn device_mismatch_fails_the_job_without_running_the_handler() {
        let runs = Arc::new(AtomicUsize::new(0));
        let handler_runs = Arc::clone(&runs);
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            move |_i: In<()>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                handler_runs.fetch_add(1, Ordering::SeqCst);
                out.emit(9)
            },
        );
        assert_eq!(inference.devices(), &[Dev(0)]);

        let job = inference.infer(()).with_devices([Dev(1)]).spawn();
        assert!(job.is_finished());
        assert_eq!(job.stream.recv(), None);
        match job.join() {
            Err(LlamaError::InvalidParameter { name, value, .. }) => {
                assert_eq!(name, "devices");
                assert!(
                    value.contains("Dev(1)") && value.contains("Dev(0)"),
                    "{value}"
                );
            }
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
        assert!(matches!(
            inference.infer(()).with_devices(Vec::new()).run(),
            Err(LlamaError::InvalidParameter {
                name: "devices",
                ..
            })
        ));
        assert_eq!(runs.load(Ordering::SeqCst), 0);

        // A list that includes the model's device, or no list at all, is fine.
        assert_eq!(
            inference
                .infer(())
                .with_devices([Dev(3), Dev(0)])
                .run()
                .unwrap(),
            vec![9]
        );
        assert_eq!(inference.infer(()).run().unwrap(), vec![9]);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        inference.shutdown().unwrap();
    }
}
