//! A one-shot answer from the serve loop to a tier that neither side's
//! runtime owns: a tier's plain thread waits for it ([`Receiver::wait`]), a
//! tier's async task awaits it (the [`Receiver`] is a `Future`), and the
//! serve loop sends without blocking ([`Sender::send`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

/// The sender went away without sending (the serve loop stopped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped;

#[derive(Debug)]
struct State<T> {
    value: Option<T>,
    /// The sender sent or was dropped.
    sender_done: bool,
    /// The receiver was dropped: a send gives the value back.
    receiver_gone: bool,
    /// The task awaiting the answer, if one is.
    waker: Option<Waker>,
}

#[derive(Debug)]
struct Slot<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The sending half.
#[derive(Debug)]
pub struct Sender<T>(Arc<Slot<T>>);

/// The receiving half.
#[derive(Debug)]
pub struct Receiver<T>(Arc<Slot<T>>);

/// A new one-shot channel.
pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let slot = Arc::new(Slot {
        state: Mutex::new(State { value: None, sender_done: false, receiver_gone: false, waker: None }),
        ready: Condvar::new(),
    });
    (Sender(slot.clone()), Receiver(slot))
}

impl<T> Sender<T> {
    /// Sends `value`; `Err(value)` if the receiver is gone.
    pub fn send(self, value: T) -> Result<(), T> {
        let mut st = self.0.lock();
        if st.receiver_gone {
            return Err(value);
        }
        st.value = Some(value);
        drop(st);
        // Dropping `self` marks the sender done and wakes the receiver.
        Ok(())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.sender_done = true;
        let waker = st.waker.take();
        drop(st);
        self.0.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// Blocks the calling thread until the answer comes (`Err` if the
    /// sender went away without one).
    pub fn wait(self) -> Result<T, Dropped> {
        let mut st = self.0.lock();
        while !st.sender_done {
            st = self.0.ready.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.value.take().ok_or(Dropped)
    }

    /// The answer if it has come; `Ok(None)` if not yet.
    pub fn try_recv(&mut self) -> Result<Option<T>, Dropped> {
        let mut st = self.0.lock();
        match st.value.take() {
            Some(v) => Ok(Some(v)),
            None if st.sender_done => Err(Dropped),
            None => Ok(None),
        }
    }
}

impl<T> Future for Receiver<T> {
    type Output = Result<T, Dropped>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.0.lock();
        if let Some(v) = st.value.take() {
            return Poll::Ready(Ok(v));
        }
        if st.sender_done {
            return Poll::Ready(Err(Dropped));
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.0.lock().receiver_gone = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_waits_for_the_answer() {
        let (tx, rx) = channel();
        let t = std::thread::spawn(move || rx.wait());
        tx.send(7u32).unwrap();
        assert_eq!(t.join().unwrap(), Ok(7));
    }

    #[test]
    fn a_dropped_sender_ends_the_wait() {
        let (tx, rx) = channel::<u32>();
        drop(tx);
        assert_eq!(rx.wait(), Err(Dropped));
    }

    #[test]
    fn a_send_to_a_dropped_receiver_gives_the_value_back() {
        let (tx, rx) = channel();
        drop(rx);
        assert_eq!(tx.send(3u8), Err(3));
    }

    #[test]
    fn a_task_awaits_the_answer() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (tx, rx) = channel();
        let sender = std::thread::spawn(move || tx.send("filled").unwrap());
        assert_eq!(rt.block_on(rx), Ok("filled"));
        sender.join().unwrap();
    }

    #[test]
    fn try_recv_sees_nothing_then_the_answer() {
        let (tx, mut rx) = channel();
        assert_eq!(rx.try_recv(), Ok(None));
        tx.send(1u8).unwrap();
        assert_eq!(rx.try_recv(), Ok(Some(1)));
    }
}
