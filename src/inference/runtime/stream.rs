//! What flows between a handler and its caller: the handler's input ([`In`]), its
//! cancellation ([`CancelToken`]), its output ([`OutStream`]) and the caller's end of that
//! output ([`JobStream`]).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::error::{LlamaError, Result};

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
/// Clones feed the same stream (handy to emit from inside a
/// [`ModelAccessor::submit`](super::ModelAccessor::submit) closure). Whatever happens, the job's stream ends when its handler returns; an
/// `OutStream` kept past that point refuses further items.
pub struct OutStream<O> {
    pub(super) items: Sender<O>,
    pub(super) cancel: CancelToken,
    pub(super) finished: Arc<AtomicBool>,
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

/// The receiving end of a job's outputs.
///
/// Yields items in emission order and ends once the handler has returned and every item
/// it emitted has been read. Dropping the stream cancels the job.
pub struct JobStream<O> {
    pub(super) items: Receiver<O>,
    /// Disconnected when the handler has returned.
    pub(super) done: Receiver<()>,
    pub(super) cancel: CancelToken,
    /// Set once the end has been reported, so it is reported forever after.
    pub(super) ended: AtomicBool,
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
    use super::super::testkit::*;
    use super::*;
    use std::thread;

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
        let endless = endless_inference();
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
