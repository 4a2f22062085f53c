//! What travels between two ranks of a [`TcpGroup`](super::TcpGroup), and how.
//!
//! **Frames.** Every message is a 40-byte header (kind, operation, sequence number, length,
//! argument, payload size), checked against the receiver's own call, then the payload. An abort
//! frame carries the reason instead.
//!
//! **Transfers.** A collective is a set of sends and receives over non-blocking sockets,
//! progressed together by one thread with `poll(2)`: no thread is spawned and nothing is
//! allocated per call. Received payload bytes are handed to the caller as they arrive (a ring
//! all-reduce adds them while the rest is still on the wire). A peer that closes its connection
//! is [`CommError::PeerLeft`], silence past the deadline [`CommError::Timeout`] naming the peers
//! still owing data, an abort frame [`CommError::Aborted`] with the peer's reason.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::group::Collective;
use crate::group::call::Call;

pub(super) const HEADER_BYTES: usize = 40;
pub(super) const KIND_DATA: u8 = 1;
pub(super) const KIND_ABORT: u8 = 2;
/// How long an abort frame may take to write before the peer is given up.
pub(super) const ABORT_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest a transfer sleeps in `poll` before it looks at the clock again.
const POLL_SLICE: Duration = Duration::from_millis(100);

/// The header of a frame of `kind` for `call` with `payload` bytes.
pub(super) fn header(kind: u8, call: &Call, payload: usize) -> [u8; HEADER_BYTES] {
    let (code, len, arg) = call.op.encode();
    let mut h = [0u8; HEADER_BYTES];
    h[0] = kind;
    h[1] = code;
    h[8..16].copy_from_slice(&call.seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h[24..32].copy_from_slice(&arg.to_le_bytes());
    h[32..40].copy_from_slice(&(payload as u64).to_le_bytes());
    h
}

/// The little-endian `u64` at the start of `bytes`.
pub(super) fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(w)
}

/// One connection to another rank.
pub(super) struct Peer {
    pub addr: String,
    /// The connection, non-blocking; held by the collective that uses it.
    stream: Mutex<TcpStream>,
    /// A second handle on the connection, for `shutdown` while a collective holds the stream.
    control: TcpStream,
    /// Set when a write failed part-way: the stream may end inside a frame, so no abort frame
    /// may follow on it.
    broken: AtomicBool,
}

impl Peer {
    /// Wraps a connected stream (after its handshake), non-blocking and without Nagle's delay.
    pub fn new(addr: String, stream: TcpStream) -> std::result::Result<Peer, String> {
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        let control = stream.try_clone().map_err(|e| e.to_string())?;
        Ok(Peer {
            addr,
            stream: Mutex::new(stream),
            control,
            broken: AtomicBool::new(false),
        })
    }

    /// Closes the connection in both directions (peers blocked on it see the end of stream).
    pub fn shut_down(&self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }

    /// Writes an abort frame carrying `reason` when no collective holds the stream and no
    /// frame was cut short on it, then closes the writing side: peers waiting on this
    /// connection read the reason, then the end of the stream.
    pub fn send_abort(&self, call: &Call, reason: &str) {
        if !self.broken.load(Ordering::Relaxed)
            && let Ok(mut stream) = self.stream.try_lock()
        {
            let deadline = Instant::now() + ABORT_WRITE_TIMEOUT;
            let frame = header(KIND_ABORT, call, reason.len());
            let _ = write_all_until(&mut stream, &frame, deadline)
                .and_then(|()| write_all_until(&mut stream, reason.as_bytes(), deadline));
        }
        let _ = self.control.shutdown(Shutdown::Write);
    }
}

/// Writes all of `buf` on a non-blocking stream before `deadline`.
fn write_all_until(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                wait(&[(&*stream, Interest::Write)], Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A frame to send to `peer`.
pub(super) struct Outgoing<'a> {
    pub peer: usize,
    header: [u8; HEADER_BYTES],
    payload: &'a [u8],
    done: usize,
}

impl<'a> Outgoing<'a> {
    pub fn new(call: &Call, peer: usize, payload: &'a [u8]) -> Self {
        Self {
            peer,
            header: header(KIND_DATA, call, payload.len()),
            payload,
            done: 0,
        }
    }

    fn finished(&self) -> bool {
        self.done == HEADER_BYTES + self.payload.len()
    }

    /// The bytes still to write.
    fn pending(&self) -> &[u8] {
        if self.done < HEADER_BYTES {
            &self.header[self.done..]
        } else {
            &self.payload[self.done - HEADER_BYTES..]
        }
    }
}

/// A frame to receive from `peer` into `out`, which must be exactly its payload.
pub(super) struct Incoming<'a> {
    pub peer: usize,
    header: [u8; HEADER_BYTES],
    out: &'a mut [u8],
    done: usize,
    /// Payload bytes already handed to the caller's `arrived` callback.
    handed: usize,
}

impl<'a> Incoming<'a> {
    pub fn new(peer: usize, out: &'a mut [u8]) -> Self {
        Self {
            peer,
            header: [0; HEADER_BYTES],
            out,
            done: 0,
            handed: 0,
        }
    }

    fn finished(&self) -> bool {
        self.done == HEADER_BYTES + self.out.len()
    }
}

#[derive(Clone, Copy)]
enum Interest {
    Read,
    Write,
}

/// Waits until one of `streams` is ready for its interest, or `timeout` passes.
#[cfg(unix)]
fn wait(streams: &[(&TcpStream, Interest)], timeout: Duration) {
    use std::os::unix::io::AsRawFd;
    let mut fds: Vec<libc::pollfd> = streams
        .iter()
        .map(|(s, interest)| libc::pollfd {
            fd: s.as_raw_fd(),
            events: match interest {
                Interest::Read => libc::POLLIN,
                Interest::Write => libc::POLLOUT,
            },
            revents: 0,
        })
        .collect();
    let millis = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures for the call's duration.
    unsafe {
        libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis);
    }
}

#[cfg(not(unix))]
fn wait(_streams: &[(&TcpStream, Interest)], timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_micros(200)));
}

/// The timeout of `call`, naming the peers whose sends or receives are unfinished.
fn timed_out(call: &Call, sends: &[Outgoing<'_>], receives: &[Incoming<'_>]) -> CommError {
    let mut missing: Vec<usize> = receives
        .iter()
        .filter(|r| !r.finished())
        .map(|r| r.peer)
        .chain(sends.iter().filter(|s| !s.finished()).map(|s| s.peer))
        .collect();
    missing.sort_unstable();
    missing.dedup();
    call.timed_out(missing, Vec::new())
}

/// The peers of a collective, each stream locked once for its duration.
pub(super) struct Streams<'g> {
    peers: &'g [Option<Peer>],
    locked: Vec<(usize, MutexGuard<'g, TcpStream>)>,
}

impl<'g> Streams<'g> {
    /// Locks the streams to `ranks` (each once).
    pub fn lock(peers: &'g [Option<Peer>], ranks: &[usize]) -> Self {
        let mut locked: Vec<(usize, MutexGuard<'g, TcpStream>)> = Vec::with_capacity(ranks.len());
        for &rank in ranks {
            if locked.iter().any(|(r, _)| *r == rank) {
                continue;
            }
            if let Some(peer) = &peers[rank] {
                let guard = peer.stream.lock().unwrap_or_else(|p| p.into_inner());
                locked.push((rank, guard));
            }
        }
        Self { peers, locked }
    }

    fn stream(&mut self, rank: usize) -> &mut TcpStream {
        let at = self
            .locked
            .iter()
            .position(|(r, _)| *r == rank)
            .unwrap_or_default();
        &mut self.locked[at].1
    }

    fn peer(&self, rank: usize) -> Option<&'g Peer> {
        self.peers.get(rank).and_then(Option::as_ref)
    }

    /// Progresses `sends` and `receives` together until all are done; whenever payload bytes
    /// arrive for a receive, `arrived(index of the receive, its payload so far)` is called (the
    /// prefix that arrived, which only grows). Fails at the first broken connection, mismatching
    /// frame, abort frame or when `call`'s deadline passes.
    pub fn transfer(
        &mut self,
        call: &Call,
        sends: &mut [Outgoing<'_>],
        receives: &mut [Incoming<'_>],
        mut arrived: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        loop {
            let mut progressed = false;
            for send in sends.iter_mut().filter(|s| !s.finished()) {
                progressed |= self.write_ready(call, send)?;
            }
            for (index, receive) in receives.iter_mut().enumerate() {
                if !receive.finished() {
                    progressed |=
                        self.read_ready(call, receive, |so_far| arrived(index, so_far))?;
                }
            }
            if sends.iter().all(Outgoing::finished) && receives.iter().all(Incoming::finished) {
                return Ok(());
            }
            if progressed {
                continue;
            }
            if call.expired() {
                return Err(timed_out(call, sends, receives));
            }
            let now = Instant::now();
            let slice = call.deadline.map_or(POLL_SLICE, |d| {
                d.saturating_duration_since(now).min(POLL_SLICE)
            });
            self.wait_for_any(sends, receives, slice);
        }
    }

    /// Writes as much of `send` as its socket takes now; whether anything was written.
    fn write_ready(&mut self, call: &Call, send: &mut Outgoing<'_>) -> Result<bool> {
        let peer = send.peer;
        let mut progressed = false;
        loop {
            let pending = send.pending();
            if pending.is_empty() {
                return Ok(progressed);
            }
            match self.stream(peer).write(pending) {
                Ok(0) => {
                    return Err(self.io_error(
                        call,
                        peer,
                        io::ErrorKind::WriteZero.into(),
                        "sending to",
                    ));
                }
                Ok(n) => {
                    send.done += n;
                    progressed = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                Err(e) => {
                    if let Some(p) = self.peer(peer) {
                        p.broken.store(true, Ordering::Relaxed);
                    }
                    return Err(self.io_error(call, peer, e, "sending to"));
                }
            }
        }
    }

    /// Reads what `receive`'s socket holds now: the header first (checked against `call` once
    /// complete), then the payload, handing each longer prefix of it to `arrived`; whether
    /// anything was read.
    fn read_ready(
        &mut self,
        call: &Call,
        receive: &mut Incoming<'_>,
        mut arrived: impl FnMut(&[u8]),
    ) -> Result<bool> {
        let peer = receive.peer;
        let mut progressed = false;
        loop {
            let result = if receive.done < HEADER_BYTES {
                let at = receive.done;
                self.stream(peer).read(&mut receive.header[at..])
            } else {
                let at = receive.done - HEADER_BYTES;
                if at == receive.out.len() {
                    return Ok(progressed);
                }
                self.stream(peer).read(&mut receive.out[at..])
            };
            match result {
                Ok(0) => {
                    return Err(self.io_error(
                        call,
                        peer,
                        io::ErrorKind::UnexpectedEof.into(),
                        "waiting for",
                    ));
                }
                Ok(n) => {
                    let was_header = receive.done < HEADER_BYTES;
                    receive.done += n;
                    progressed = true;
                    if was_header && receive.done == HEADER_BYTES {
                        self.check_header(call, peer, &receive.header, receive.out.len())?;
                    }
                    if receive.done > HEADER_BYTES {
                        let end = receive.done - HEADER_BYTES;
                        if end > receive.handed {
                            arrived(&receive.out[..end]);
                            receive.handed = end;
                        }
                    }
                    if receive.finished() {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                Err(e) => return Err(self.io_error(call, peer, e, "waiting for")),
            }
        }
    }

    /// Waits up to `slice` until a socket of an unfinished send can be written or one of an
    /// unfinished receive read.
    fn wait_for_any(&self, sends: &[Outgoing<'_>], receives: &[Incoming<'_>], slice: Duration) {
        let interests = sends
            .iter()
            .filter(|s| !s.finished())
            .map(|s| (s.peer, Interest::Write))
            .chain(
                receives
                    .iter()
                    .filter(|r| !r.finished())
                    .map(|r| (r.peer, Interest::Read)),
            );
        let streams: Vec<(&TcpStream, Interest)> = interests
            .map(|(rank, interest)| {
                let at = self
                    .locked
                    .iter()
                    .position(|(r, _)| *r == rank)
                    .unwrap_or_default();
                (&*self.locked[at].1, interest)
            })
            .collect();
        wait(&streams, slice);
    }

    /// Checks a frame header from `peer` against `call`; an abort frame becomes the peer's
    /// reason.
    fn check_header(
        &mut self,
        call: &Call,
        peer: usize,
        h: &[u8; HEADER_BYTES],
        expected: usize,
    ) -> Result<()> {
        let payload = word(&h[32..40]) as usize;
        if h[0] == KIND_ABORT {
            let mut reason = vec![0u8; payload.min(64 << 10)];
            let mut read = 0;
            let deadline = Instant::now() + ABORT_WRITE_TIMEOUT;
            while read < reason.len() && Instant::now() < deadline {
                match self.stream(peer).read(&mut reason[read..]) {
                    Ok(0) => break,
                    Ok(n) => read += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            reason.truncate(read);
            return Err(CommError::Aborted {
                rank: call.rank,
                op: call.op,
                seq: call.seq,
                cause: format!("rank {peer} gave up: {}", String::from_utf8_lossy(&reason)),
            });
        }
        let peer_seq = word(&h[8..16]);
        let Some(peer_op) = Collective::decode(h[1], word(&h[16..24]), word(&h[24..32]))
            .filter(|_| h[0] == KIND_DATA)
        else {
            return Err(CommError::PeerLeft {
                rank: call.rank,
                op: call.op,
                seq: call.seq,
                peer,
                reason: "garbled stream (not a burn-ddp frame)".into(),
            });
        };
        if peer_op != call.op || peer_seq != call.seq || payload != expected {
            return Err(CommError::Mismatch {
                rank: call.rank,
                op: call.op,
                seq: call.seq,
                peer,
                peer_op,
                peer_seq,
            });
        }
        Ok(())
    }

    fn io_error(&self, call: &Call, peer: usize, e: io::Error, doing: &str) -> CommError {
        let addr = self.peer(peer).map(|p| p.addr.as_str()).unwrap_or("?");
        CommError::PeerLeft {
            rank: call.rank,
            op: call.op,
            seq: call.seq,
            peer,
            reason: match e.kind() {
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => format!(
                    "connection to {addr} closed while {doing} it (its process ended or was \
                     killed)"
                ),
                _ => format!("{doing} {addr}: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_collective_round_trips_through_a_header() {
        let calls = crate::group::tests::every_kind();
        for op in calls {
            let call = Call::new(0, 42, op, Duration::ZERO);
            let h = header(KIND_DATA, &call, 12);
            assert_eq!(
                Collective::decode(h[1], word(&h[16..24]), word(&h[24..32])),
                Some(op)
            );
            assert_eq!(word(&h[8..16]), 42);
            assert_eq!(word(&h[32..40]), 12);
        }
    }
}
