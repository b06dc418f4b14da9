//! The model host thread: [`ModelHost`] owns the model and runs submitted closures on it
//! in FIFO order; [`ModelAccessor`] submits them from any thread.

use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread::{self, JoinHandle, ThreadId};

use crossbeam_channel::{Receiver, Sender};

use crate::error::{LlamaError, Result};

/// The devices a model's tensors live on.
///
/// [`InferenceBuilder::build`](super::InferenceBuilder::build) reads them once, on the
/// model thread, and a job asking for devices
/// ([`JobBuilder::with_devices`](super::JobBuilder::with_devices)) is only run if the
/// model lives on one of them.
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
    pub(super) fn closed() -> Self {
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
/// [`InferenceBuilder`](super::InferenceBuilder) uses one internally; use it directly to
/// build other serving strategies on the same pattern. The thread stops, dropping the model, once the
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
    pub(super) accessor: ModelAccessor<M>,
    pub(super) thread: JoinHandle<M>,
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

pub(super) fn join_model_thread<M>(thread: JoinHandle<M>) -> Result<M> {
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
pub(super) fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(text) = payload.downcast_ref::<&'static str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(non-text panic payload)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

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
}
