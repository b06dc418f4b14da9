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

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::thread::{self, JoinHandle, ThreadId};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::error::{LlamaError, Result};

// ---------------------------------------------------------------------------------------
// Small types handed to handlers
// ---------------------------------------------------------------------------------------

/// A job's input, as a handler receives it.
///
/// A tuple struct so that handlers can destructure it in the parameter list:
/// `In(request): In<GenerateRequest>`.
///
/// ```
/// use llama_burn::inference::In;
///
/// let In(prompt) = In("Hello");
/// assert_eq!(prompt, "Hello");
/// assert_eq!(In(3).into_inner(), 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct In<T>(pub T);

impl<T> In<T> {
    /// Unwraps the input.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> Deref for In<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for In<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// A shared cancellation flag.
///
/// Clones share one flag: cancelling any clone cancels them all, and cancellation is
/// permanent. Each job has one; the handler gets a clone and should check it between
/// steps (its [`OutStream`] checks it too, on every [`OutStream::emit`]).
///
/// ```
/// use llama_burn::error::LlamaError;
/// use llama_burn::inference::CancelToken;
///
/// let token = CancelToken::new();
/// let seen_elsewhere = token.clone();
/// assert!(token.check().is_ok());
/// seen_elsewhere.cancel();
/// assert!(token.is_cancelled());
/// assert!(matches!(token.check(), Err(LlamaError::Cancelled)));
/// ```
#[derive(Clone, Default)]
pub struct CancelToken {
    flag: Arc<AtomicBool>,
}

impl CancelToken {
    /// A new, not yet cancelled token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels every clone of this token. Idempotent.
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
    }

    /// Whether this token (or any clone) has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// `Err(LlamaError::Cancelled)` if cancelled, `Ok(())` otherwise, so handlers can
    /// write `cancel.check()?;` between steps.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Cancelled`] once the token has been cancelled.
    pub fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            Err(LlamaError::Cancelled)
        } else {
            Ok(())
        }
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

/// Where a handler sends its results; the job's [`JobStream`] receives them in order.
///
/// Clones feed the same stream (handy to emit from inside a [`ModelAccessor::submit`]
/// closure). Whatever happens, the job's stream ends when its handler returns; an
/// `OutStream` kept past that point refuses further items.
pub struct OutStream<O> {
    items: Sender<O>,
    cancel: CancelToken,
    finished: Arc<AtomicBool>,
}

impl<O> OutStream<O> {
    /// Sends one item to the job's stream. Never blocks (the stream is unbounded).
    ///
    /// # Errors
    ///
    /// [`LlamaError::Cancelled`] if the job was cancelled, if its stream was dropped (which
    /// also cancels the job), or if the handler already returned. A handler should stop
    /// and propagate the error: `out.emit(item)?;`.
    pub fn emit(&self, item: O) -> Result<()> {
        if self.cancel.is_cancelled() || self.finished.load(Ordering::Acquire) {
            return Err(LlamaError::Cancelled);
        }
        if self.items.send(item).is_err() {
            // Nobody can read the results any more: stop the job.
            self.cancel.cancel();
            return Err(LlamaError::Cancelled);
        }
        Ok(())
    }

    /// Whether the job was cancelled (the next [`OutStream::emit`] will fail).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

impl<O> Clone for OutStream<O> {
    fn clone(&self) -> Self {
        Self {
            items: self.items.clone(),
            cancel: self.cancel.clone(),
            finished: Arc::clone(&self.finished),
        }
    }
}

impl<O> fmt::Debug for OutStream<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutStream")
            .field("cancelled", &self.cancel.is_cancelled())
            .field("finished", &self.finished.load(Ordering::Acquire))
            .finish()
    }
}

// ---------------------------------------------------------------------------------------
// The model host thread
// ---------------------------------------------------------------------------------------

/// The devices a model's tensors live on.
///
/// [`InferenceBuilder::build`] reads them once, on the model thread, and a job asking for
/// devices ([`JobBuilder::with_devices`]) is only run if the model lives on one of them.
///
/// ```
/// use llama_burn::inference::ModelDevice;
///
/// struct Toy;
///
/// impl ModelDevice for Toy {
///     type Device = u32;
///     fn devices(&self) -> Vec<u32> {
///         vec![0]
///     }
/// }
///
/// assert_eq!(Toy.devices(), vec![0]);
/// ```
pub trait ModelDevice {
    /// The device type (for Burn models, the backend's `Device`).
    type Device: Clone + PartialEq + fmt::Debug + Send + Sync + 'static;

    /// Every device the model's weights are on (usually exactly one).
    fn devices(&self) -> Vec<Self::Device>;
}

/// A closure queued for the model thread.
type Task<M> = Box<dyn FnOnce(&mut M) + Send>;

/// A handle to a model living on its own thread (see [`ModelHost`]).
///
/// Cheap to clone and to send to other threads, whatever `M` is. As long as any accessor
/// exists, the model thread keeps running.
pub struct ModelAccessor<M> {
    tasks: Sender<Task<M>>,
    /// The model thread's id, to refuse submits that would wait on themselves.
    host: Option<ThreadId>,
}

impl<M> ModelAccessor<M> {
    /// An accessor whose model is gone: every submit fails with `ModelUnavailable`.
    fn closed() -> Self {
        let (tasks, _) = crossbeam_channel::unbounded();
        Self { tasks, host: None }
    }

    /// Runs `f` on the model thread with exclusive access to the model, and returns its
    /// result. Blocks the calling thread until `f` has run.
    ///
    /// Closures run one at a time in the order they were submitted, across every thread
    /// and job. A handler should submit short steps (one token, say) so that other jobs
    /// get their turn in between.
    ///
    /// If `f` panics, the model thread survives and keeps serving later submits, but the
    /// model may be left half-updated by the interrupted closure.
    ///
    /// # Errors
    ///
    /// - [`LlamaError::ModelUnavailable`] if the model thread has stopped;
    /// - [`LlamaError::Runtime`] if `f` panicked, or if this is called from inside another
    ///   submitted closure (on the model thread, which would wait for itself forever).
    ///
    /// ```
    /// use llama_burn::inference::ModelHost;
    ///
    /// # fn main() -> Result<(), llama_burn::error::LlamaError> {
    /// let host = ModelHost::spawn(vec![1, 2, 3])?;
    /// let model = host.accessor();
    /// model.submit(|v| v.push(4))?;
    /// assert_eq!(model.submit(|v| v.iter().sum::<i32>())?, 10);
    /// drop(model);
    /// host.shutdown()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn submit<R, F>(&self, f: F) -> Result<R>
    where
        F: FnOnce(&mut M) -> R + Send + 'static,
        R: Send + 'static,
    {
        if self.host.is_some() && self.host == Some(thread::current().id()) {
            return Err(LlamaError::Runtime(
                "ModelAccessor::submit was called from inside a model closure; \
                 it would wait for itself forever"
                    .to_string(),
            ));
        }
        let (reply_tx, reply_rx) = crossbeam_channel::bounded::<Result<R, String>>(1);
        let task: Task<M> = Box::new(move |model: &mut M| {
            let outcome = catch_unwind(AssertUnwindSafe(|| f(model))).map_err(panic_message);
            // The submitter waits for this reply; if it is gone there is nobody to tell.
            let _ = reply_tx.send(outcome);
        });
        self.tasks.send(task).map_err(|_| model_gone())?;
        match reply_rx.recv() {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(message)) => Err(LlamaError::Runtime(format!(
                "a closure submitted to the model panicked: {message}"
            ))),
            // The task was dropped unrun: the model thread stopped.
            Err(_) => Err(model_gone()),
        }
    }

    /// How many submitted closures are waiting for the model (not counting the one that
    /// is running). A rough load indicator.
    pub fn queued(&self) -> usize {
        self.tasks.len()
    }
}

impl<M> Clone for ModelAccessor<M> {
    fn clone(&self) -> Self {
        Self {
            tasks: self.tasks.clone(),
            host: self.host,
        }
    }
}

impl<M> fmt::Debug for ModelAccessor<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelAccessor")
            .field("queued", &self.queued())
            .finish_non_exhaustive()
    }
}

fn model_gone() -> LlamaError {
    LlamaError::ModelUnavailable("the model thread has stopped".to_string())
}

/// A dedicated thread that owns a model and runs submitted closures on it in FIFO order.
///
/// [`InferenceBuilder`] uses one internally; use it directly to build other serving
/// strategies on the same pattern. The thread stops, dropping the model, once the
/// `ModelHost` and every [`ModelAccessor`] from it are gone.
///
/// ```
/// use llama_burn::inference::ModelHost;
///
/// # fn main() -> Result<(), llama_burn::error::LlamaError> {
/// let host = ModelHost::spawn(String::from("model"))?;
/// let len = host.accessor().submit(|s| s.len())?;
/// assert_eq!(len, 5);
/// host.shutdown()?; // the model thread has stopped and the String is dropped
/// # Ok(())
/// # }
/// ```
pub struct ModelHost<M> {
    accessor: ModelAccessor<M>,
    thread: JoinHandle<M>,
}

impl<M: Send + 'static> ModelHost<M> {
    /// Moves `model` onto a new thread named `llama-burn-model`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if the operating system refuses to start a thread (the
    /// model is then dropped).
    pub fn spawn(model: M) -> Result<Self> {
        let (tasks, queue) = crossbeam_channel::unbounded::<Task<M>>();
        let thread = thread::Builder::new()
            .name("llama-burn-model".to_string())
            .spawn(move || host_loop(model, queue))
            .map_err(|e| LlamaError::Runtime(format!("could not start the model thread: {e}")))?;
        let accessor = ModelAccessor {
            tasks,
            host: Some(thread.thread().id()),
        };
        Ok(Self { accessor, thread })
    }
}

impl<M> ModelHost<M> {
    /// A new accessor to the hosted model.
    pub fn accessor(&self) -> ModelAccessor<M> {
        self.accessor.clone()
    }

    /// Whether the model thread has stopped.
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Drops this host's own accessor and waits for the model thread to stop, which it
    /// does (dropping the model) once every other [`ModelAccessor`] is dropped too.
    ///
    /// Dropping a `ModelHost` instead lets the thread stop on its own, unwaited.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if called on the model thread itself, or if dropping the
    /// model panicked.
    pub fn shutdown(self) -> Result<()> {
        let Self { accessor, thread } = self;
        drop(accessor);
        join_model_thread(thread).map(drop)
    }
}

impl<M> fmt::Debug for ModelHost<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelHost")
            .field("queued", &self.accessor.queued())
            .field("finished", &self.is_finished())
            .finish()
    }
}

/// The model thread's body: run tasks until every sender is gone, then hand the model
/// back to whoever joins the thread.
fn host_loop<M>(mut model: M, queue: Receiver<Task<M>>) -> M {
    // Each task catches its own closure's panics, so one bad closure cannot stop the loop.
    for task in queue.iter() {
        task(&mut model);
    }
    model
}

fn join_model_thread<M>(thread: JoinHandle<M>) -> Result<M> {
    if thread.thread().id() == thread::current().id() {
        return Err(LlamaError::Runtime(
            "the model thread cannot wait for itself to stop".to_string(),
        ));
    }
    thread.join().map_err(|payload| {
        LlamaError::Runtime(format!(
            "the model thread panicked: {}",
            panic_message(payload)
        ))
    })
}

/// The text of a panic payload (a `&str` or `String` for `panic!` with a message).
fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(text) = payload.downcast_ref::<&'static str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(non-text panic payload)".to_string()
    }
}

// ---------------------------------------------------------------------------------------
// Handlers and the inference service
// ---------------------------------------------------------------------------------------

/// What a job runs: a function of the job's input, a model accessor, a cancellation token
/// and an output stream.
///
/// Implemented for every `Fn(In<I>, ModelAccessor<M>, CancelToken, OutStream<O>) ->
/// Result<(), LlamaError>` that is `Send + Sync + 'static`, generic functions included
/// (their type parameters are inferred from the model type). Implement it by hand for a
/// handler that is a struct, and pass it to [`InferenceBuilder::build_handler`].
pub trait Handler<M, I, O>: Send + Sync + 'static {
    /// Serves one job. Return `Err(LlamaError::Cancelled)` when stopping because of
    /// cancellation; the error (or `Ok`) is what [`Job::join`] reports.
    ///
    /// # Errors
    ///
    /// Whatever the handler decides; it reaches [`Job::join`] unchanged.
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
/// See the [module documentation](self) for a complete example.
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
    inner: Arc<Inner<M, I, O>>,
}

struct Inner<M: ModelDevice, I, O> {
    accessor: ModelAccessor<M>,
    /// `None` if the model thread could not be started.
    thread: Option<JoinHandle<M>>,
    /// The model's devices, or why the model cannot be used.
    devices: std::result::Result<Vec<M::Device>, String>,
    handler: Arc<dyn Handler<M, I, O>>,
    /// Where jobs go instead of a job thread, for services whose work runs on an engine
    /// thread of its own (continuous batching).
    direct: Option<DirectSubmit<I, O>>,
    next_job: AtomicU64,
    _io: PhantomData<fn(I) -> O>,
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
    fn admit(&self, requested: Option<&[M::Device]>) -> Result<()> {
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

// ---------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------

/// A job about to be started; made by [`Inference::infer`].
#[must_use = "a job does nothing until `spawn` or `run` is called"]
pub struct JobBuilder<M: ModelDevice, I, O> {
    inference: Inference<M, I, O>,
    input: I,
    devices: Option<Vec<M::Device>>,
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

/// The receiving end of a job's outputs.
///
/// Yields items in emission order and ends once the handler has returned and every item
/// it emitted has been read. Dropping the stream cancels the job.
pub struct JobStream<O> {
    items: Receiver<O>,
    /// Disconnected when the handler has returned.
    done: Receiver<()>,
    cancel: CancelToken,
    /// Set once the end has been reported, so it is reported forever after.
    ended: AtomicBool,
}

impl<O> JobStream<O> {
    /// Waits for the next item; `None` once the stream has ended.
    pub fn recv(&self) -> Option<O> {
        if self.is_ended() {
            return None;
        }
        let item = crossbeam_channel::select! {
            recv(self.items) -> item => item.ok(),
            // Finished: everything the handler emitted is already queued.
            recv(self.done) -> _ => self.items.try_recv().ok(),
        };
        if item.is_none() {
            self.end();
        }
        item
    }

    /// Waits at most `timeout` for the next item.
    ///
    /// # Errors
    ///
    /// [`RecvTimeoutError::Timeout`] if nothing arrived in time,
    /// [`RecvTimeoutError::Disconnected`] once the stream has ended.
    pub fn recv_timeout(&self, timeout: Duration) -> std::result::Result<O, RecvTimeoutError> {
        if self.is_ended() {
            return Err(RecvTimeoutError::Disconnected);
        }
        let item = crossbeam_channel::select! {
            recv(self.items) -> item => item.map_err(|_| RecvTimeoutError::Disconnected),
            recv(self.done) -> _ => self
                .items
                .try_recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
            default(timeout) => Err(RecvTimeoutError::Timeout),
        };
        if let Err(RecvTimeoutError::Disconnected) = item {
            self.end();
        }
        item
    }

    /// Takes the next item if one is ready, without waiting.
    ///
    /// # Errors
    ///
    /// [`TryRecvError::Empty`] if the job is still running but has nothing new,
    /// [`TryRecvError::Disconnected`] once the stream has ended.
    pub fn try_recv(&self) -> std::result::Result<O, TryRecvError> {
        if self.is_ended() {
            return Err(TryRecvError::Disconnected);
        }
        // Look at `done` first: if the handler has returned, everything is queued.
        let finished = matches!(
            self.done.try_recv(),
            Err(crossbeam_channel::TryRecvError::Disconnected)
        );
        match self.items.try_recv() {
            Ok(item) => Ok(item),
            Err(crossbeam_channel::TryRecvError::Empty) if !finished => Err(TryRecvError::Empty),
            Err(_) => {
                self.end();
                Err(TryRecvError::Disconnected)
            }
        }
    }

    /// A blocking iterator over the items; see [`JobStream::recv`].
    pub fn iter(&self) -> Iter<'_, O> {
        Iter { stream: self }
    }

    /// Whether the end of the stream has been reached (and reported).
    pub fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Cancels the job while keeping the stream, to read what was already emitted.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
    }
}

impl<O> Drop for JobStream<O> {
    fn drop(&mut self) {
        // Nobody will read the outputs: tell the handler to stop.
        self.cancel.cancel();
    }
}

impl<O> fmt::Debug for JobStream<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobStream")
            .field("buffered", &self.items.len())
            .field("ended", &self.is_ended())
            .finish()
    }
}

/// Borrowing iterator over a [`JobStream`].
pub struct Iter<'a, O> {
    stream: &'a JobStream<O>,
}

impl<O> Iterator for Iter<'_, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        self.stream.recv()
    }
}

impl<O> fmt::Debug for Iter<'_, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Iter").field(self.stream).finish()
    }
}

/// Owning iterator over a [`JobStream`]; dropping it cancels the job.
pub struct IntoIter<O> {
    stream: JobStream<O>,
}

impl<O> Iterator for IntoIter<O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        self.stream.recv()
    }
}

impl<O> fmt::Debug for IntoIter<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IntoIter").field(&self.stream).finish()
    }
}

impl<O> IntoIterator for JobStream<O> {
    type Item = O;
    type IntoIter = IntoIter<O>;

    fn into_iter(self) -> IntoIter<O> {
        IntoIter { stream: self }
    }
}

impl<'a, O> IntoIterator for &'a JobStream<O> {
    type Item = O;
    type IntoIter = Iter<'a, O>;

    fn into_iter(self) -> Iter<'a, O> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::sync::atomic::AtomicUsize;

    /// Generous bound that only turns a would-be hang into a failure; never a timing
    /// assertion.
    const HANG_GUARD: Duration = Duration::from_secs(60);

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Dev(u8);

    /// A toy model: a log of what was done to it, and a signal when it is dropped.
    struct Toy {
        log: Vec<(u32, u32)>,
        dropped: Option<Sender<()>>,
        device: Dev,
    }

    impl Toy {
        fn new() -> Self {
            Self {
                log: Vec::new(),
                dropped: None,
                device: Dev(0),
            }
        }

        fn with_drop_signal() -> (Self, Receiver<()>) {
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
    fn steps_handler(
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

    fn toy_inference() -> Inference<Toy, (u32, u32), u32> {
        InferenceBuilder::new()
            .with_model(Toy::new())
            .build(steps_handler)
    }

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
    fn submits_from_one_thread_run_in_order() {
        let host = ModelHost::spawn(Vec::<u32>::new()).unwrap();
        let model = host.accessor();
        for i in 0..100 {
            model.submit(move |v| v.push(i)).unwrap();
        }
        let log = model.submit(|v| v.clone()).unwrap();
        assert_eq!(log, (0..100).collect::<Vec<_>>());
        drop(model);
        host.shutdown().unwrap();
    }

    #[test]
    fn submits_from_many_threads_run_first_come_first_served() {
        let host = ModelHost::spawn(Vec::<u32>::new()).unwrap();
        let model = host.accessor();
        // Hold the model thread so the following submits queue up in a known order.
        let (entered_tx, entered_rx) = crossbeam_channel::bounded(0);
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
        let gate = {
            let model = model.clone();
            thread::spawn(move || {
                model
                    .submit(move |_v| {
                        entered_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                    })
                    .unwrap();
            })
        };
        entered_rx.recv().unwrap();
        let mut submitters = Vec::new();
        for i in 0..8u32 {
            let model_i = model.clone();
            submitters.push(thread::spawn(move || model_i.submit(move |v| v.push(i))));
            // Wait until submit `i` is queued before starting the next submitter.
            while model.queued() < i as usize + 1 {
                thread::yield_now();
            }
        }
        release_tx.send(()).unwrap();
        gate.join().unwrap();
        for s in submitters {
            s.join().unwrap().unwrap();
        }
        assert_eq!(
            model.submit(|v| v.clone()).unwrap(),
            (0..8).collect::<Vec<_>>()
        );
        drop(model);
        host.shutdown().unwrap();
    }

    #[test]
    fn panicking_submit_does_not_kill_the_model_thread() {
        let inference = toy_inference();
        inference
            .with_model_blocking(|toy| toy.log.push((7, 7)))
            .unwrap();
        let err = inference
            .with_model_blocking(|_toy| -> u32 { panic!("boom in the model") })
            .unwrap_err();
        match err {
            LlamaError::Runtime(msg) => {
                assert!(
                    msg.contains("panicked") && msg.contains("boom in the model"),
                    "{msg}"
                )
            }
            other => panic!("expected Runtime, got {other:?}"),
        }
        // Still alive, model intact, jobs still work.
        assert_eq!(
            inference
                .with_model_blocking(|toy| toy.log.clone())
                .unwrap(),
            vec![(7, 7)]
        );
        assert_eq!(inference.infer((1, 2)).run().unwrap(), vec![1000, 1001]);
        inference.shutdown().unwrap();
    }

    #[test]
    fn nested_submit_is_refused_instead_of_deadlocking() {
        let host = ModelHost::spawn(0u32).unwrap();
        let model = host.accessor();
        let inner = model.clone();
        let nested = model.submit(move |_| inner.submit(|x| *x)).unwrap();
        assert!(matches!(nested, Err(LlamaError::Runtime(_))), "{nested:?}");
        drop(model);
        host.shutdown().unwrap();
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

    /// Emits 0, 1, 2, ... until told to stop (via emit failing).
    fn endless_handler(
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

    #[test]
    fn cancel_mid_stream_stops_the_job() {
        let inference = InferenceBuilder::new()
            .with_model(Toy::new())
            .build(endless_handler);
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
        let inference = InferenceBuilder::new()
            .with_model(Toy::new())
            .build(endless_handler);
        let job = inference.infer(()).spawn();
        assert_eq!(job.stream.recv(), Some(0));
        let token = job.cancel_token();
        thread::spawn(move || token.cancel()).join().unwrap();
        for _ in job.stream.iter() {}
        assert!(matches!(job.join(), Err(LlamaError::Cancelled)));
        inference.shutdown().unwrap();
    }

    #[test]
    fn dropping_the_stream_cancels_the_job() {
        // This handler never emits after its first item: it can only notice the
        // cancellation through its token.
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |_input: In<()>,
             model: ModelAccessor<Toy>,
             cancel: CancelToken,
             out: OutStream<u32>| {
                out.emit(1)?;
                while !cancel.is_cancelled() {
                    model.submit(|_| ())?;
                }
                Err(LlamaError::Cancelled)
            },
        );
        let job = inference.infer(()).spawn();
        let (stream, handle) = job.split();
        assert_eq!(stream.recv(), Some(1));
        assert!(!handle.is_cancelled());
        drop(stream);
        assert!(handle.is_cancelled());
        assert!(matches!(handle.join(), Err(LlamaError::Cancelled)));

        // Dropping the whole job (stream included) stops an endless emitter too.
        let endless = InferenceBuilder::new()
            .with_model(Toy::new())
            .build(endless_handler);
        let job = endless.infer(()).spawn();
        let token = job.cancel_token();
        assert_eq!(job.stream.recv(), Some(0));
        drop(job);
        assert!(token.is_cancelled());
        // The detached handler stops, releasing the model: shutdown returns.
        endless.shutdown().unwrap();
        inference.shutdown().unwrap();
    }

    #[test]
    fn emit_fails_once_the_receiver_is_gone() {
        let (got_result_tx, got_result_rx) = crossbeam_channel::bounded(1);
        let (dropped_tx, dropped_rx) = crossbeam_channel::bounded::<()>(1);
        type Input = (Sender<Result<()>>, Receiver<()>);
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |In((report, dropped)): In<Input>,
             _model: ModelAccessor<Toy>,
             cancel: CancelToken,
             out: OutStream<u32>| {
                dropped.recv().ok();
                assert!(cancel.is_cancelled());
                report.send(out.emit(5)).ok();
                Ok(())
            },
        );
        let job = inference.infer((got_result_tx, dropped_rx)).spawn();
        let (stream, handle) = job.split();
        drop(stream);
        dropped_tx.send(()).unwrap();
        assert!(matches!(
            got_result_rx.recv_timeout(HANG_GUARD),
            Ok(Err(LlamaError::Cancelled))
        ));
        handle.join().unwrap();
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

    #[test]
    fn stream_receive_methods() {
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(0);
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            move |_i: In<()>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                out.emit(1)?;
                go_rx.recv().ok();
                out.emit(2)
            },
        );
        let job = inference.infer(()).spawn();
        assert_eq!(job.stream.recv_timeout(HANG_GUARD), Ok(1));
        // The handler is parked until `go`: nothing is ready.
        assert_eq!(job.stream.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(
            job.stream.recv_timeout(Duration::from_millis(1)),
            Err(RecvTimeoutError::Timeout)
        );
        go_tx.send(()).unwrap();
        assert_eq!(job.stream.recv_timeout(HANG_GUARD), Ok(2));
        assert_eq!(
            job.stream.recv_timeout(HANG_GUARD),
            Err(RecvTimeoutError::Disconnected)
        );
        assert_eq!(job.stream.try_recv(), Err(TryRecvError::Disconnected));
        assert_eq!(job.stream.recv(), None);
        assert_eq!((&job.stream).into_iter().count(), 0);
        job.join().unwrap();

        // Owning iteration.
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
        go_tx.send(()).unwrap();
        drop(go_tx);
        let inference2 = InferenceBuilder::new().with_model(Toy::new()).build(
            move |_i: In<()>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                go_rx.recv().ok();
                out.emit(1)?;
                out.emit(2)
            },
        );
        let (stream, handle) = inference2.infer(()).spawn().split();
        assert_eq!(stream.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        handle.join().unwrap();
        inference.shutdown().unwrap();
        inference2.shutdown().unwrap();
    }

    #[test]
    fn try_recv_drains_everything_after_the_handler_returns() {
        let inference = toy_inference();
        let job = inference.infer((1, 10)).spawn();
        // Wait, without reading, for the handler to return.
        while !job.is_finished() {
            thread::yield_now();
        }
        let mut got = Vec::new();
        loop {
            match job.stream.try_recv() {
                Ok(x) => got.push(x),
                Err(TryRecvError::Empty) => panic!("finished job reported Empty"),
                Err(TryRecvError::Disconnected) => break,
            }
        }
        assert_eq!(got, (1000..1010).collect::<Vec<_>>());
        job.join().unwrap();
        inference.shutdown().unwrap();
    }

    #[test]
    fn stream_ends_when_handler_returns_even_if_an_outstream_clone_leaks() {
        let (leak_tx, leak_rx) = crossbeam_channel::unbounded::<OutStream<u8>>();
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            move |_i: In<()>, _m: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u8>| {
                out.emit(1)?;
                leak_tx.send(out.clone()).ok();
                Ok(())
            },
        );
        let job = inference.infer(()).spawn();
        assert_eq!(job.stream.recv_timeout(HANG_GUARD), Ok(1));
        assert_eq!(
            job.stream.recv_timeout(HANG_GUARD),
            Err(RecvTimeoutError::Disconnected)
        );
        let leaked = leak_rx.recv().unwrap();
        assert!(matches!(leaked.emit(2), Err(LlamaError::Cancelled)));
        assert_eq!(job.stream.recv(), None);
        job.join().unwrap();
        drop(leaked);
        inference.shutdown().unwrap();
    }

    #[test]
    fn emitting_from_inside_a_model_closure() {
        let inference = InferenceBuilder::new().with_model(Toy::new()).build(
            |_i: In<()>, model: ModelAccessor<Toy>, _c: CancelToken, out: OutStream<u32>| {
                let out2 = out.clone();
                model.submit(move |toy| {
                    toy.log.push((0, 0));
                    out2.emit(toy.log.len() as u32)
                })??;
                out.emit(100)
            },
        );
        assert_eq!(inference.infer(()).run().unwrap(), vec![1, 100]);
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
    fn accessor_without_a_model_thread_reports_model_unavailable() {
        // What every accessor of a service whose model thread could not start gets.
        let closed = ModelAccessor::<u8>::closed();
        assert!(matches!(
            closed.submit(|x| *x),
            Err(LlamaError::ModelUnavailable(_))
        ));
        assert!(matches!(
            closed.clone().submit(|x| *x),
            Err(LlamaError::ModelUnavailable(_))
        ));
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
    fn in_wrapper_and_debug_output() {
        let mut input = In(vec![1, 2]);
        input.push(3);
        assert_eq!(input.len(), 3);
        assert_eq!(input.into_inner(), vec![1, 2, 3]);
        let inference = toy_inference();
        let text = format!("{inference:?}");
        assert!(text.contains("Dev(0)"), "{text}");
        let job = inference.infer((1, 1)).spawn();
        assert!(format!("{job:?}").starts_with("Job"));
        job.join().unwrap();
        assert!(format!("{:?}", CancelToken::new()).contains("cancelled: false"));
        inference.shutdown().unwrap();
    }
}
