//! The store's client: one connection, each operation with its timeout.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::{
    HANDSHAKE_DEADLINE, MAX_KEY, MAX_KEYS, MAX_VALUE, MAX_WAIT, OP_ADD, OP_CHECK, OP_GET, OP_SET,
    OP_WAIT, STATUS_OK, STATUS_REFUSED, STATUS_TIMEOUT, millis, put_bytes, put_keys, read_bytes,
    read_u8, read_u64, refusal, store_error,
};
use crate::auth::{self, JobIdentity, Role, Service};
use crate::error::Result;

/// A connection to the store.
pub struct StoreClient {
    addr: String,
    pub(super) stream: Mutex<TcpStream>,
    local_ip: std::net::IpAddr,
    /// Set after an I/O error or a reply that did not come: a late reply would otherwise be read
    /// as the answer to the next request.
    broken: AtomicBool,
}

/// Extra time a client waits for a reply beyond the operation's own timeout (network latency).
const REPLY_SLACK: Duration = Duration::from_secs(10);

impl StoreClient {
    /// Connects to the store at `addr` (`host:port`, an IPv6 address in brackets) as a process
    /// of `job` in `role`, retrying until `timeout` passes, since the server may start after the
    /// clients. The handshake proves the job's key both ways.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) when no store answers at `addr` within `timeout`, `addr` does not
    /// resolve, the service at `addr` is not a burn-ddp store (naming what it is), the store
    /// belongs to another run (naming both run ids), or either side does not hold the job's key.
    pub fn connect(
        addr: &str,
        timeout: Duration,
        job: &JobIdentity,
        role: Role,
    ) -> Result<StoreClient> {
        let deadline = Instant::now().checked_add(timeout);
        let mut last_error = String::from("no address");
        loop {
            // Resolve on every try: a host name may appear in DNS after the job started.
            let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(resolved) => resolved.collect(),
                Err(e) => {
                    last_error = format!("cannot resolve {addr}: {e}");
                    Vec::new()
                }
            };
            for candidate in &resolved {
                match TcpStream::connect_timeout(candidate, Duration::from_secs(2)) {
                    Ok(mut stream) => {
                        let _ = stream.set_nodelay(true);
                        let local_ip = stream
                            .local_addr()
                            .map_err(|e| store_error(addr, "connect", e.to_string()))?
                            .ip();
                        match auth::connect(
                            &mut stream,
                            job,
                            Service::Store,
                            role,
                            b"",
                            HANDSHAKE_DEADLINE,
                        ) {
                            Ok(_) => {}
                            Err(auth::Refusal::Busy) => {
                                last_error = "the store is busy with other connections".into();
                                continue;
                            }
                            Err(why) => {
                                return Err(store_error(addr, "connect", refusal(&why, job)));
                            }
                        }
                        return Ok(StoreClient {
                            addr: addr.to_string(),
                            stream: Mutex::new(stream),
                            local_ip,
                            broken: AtomicBool::new(false),
                        });
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(store_error(
                    addr,
                    "connect",
                    format!(
                        "no store answered within {} s ({last_error}); is rank 0 (or the \
                         launcher) running, and are MASTER_ADDR and MASTER_PORT right?",
                        timeout.as_secs_f64()
                    ),
                ));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The store's address, as given to [`connect`](Self::connect).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The local IP address of this connection: the address this host uses to reach the store.
    pub fn local_ip(&self) -> std::net::IpAddr {
        self.local_ip
    }

    fn request(&self, op_name: &str, request: &[u8], timeout: Duration) -> Result<(u8, Vec<u8>)> {
        if self.broken.load(Ordering::Relaxed) {
            return Err(store_error(
                &self.addr,
                op_name,
                "this connection failed earlier; reconnect".into(),
            ));
        }
        let fail = |e: io::Error| {
            self.broken.store(true, Ordering::Relaxed);
            let detail = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    format!(
                        "no reply within {} s",
                        (timeout + REPLY_SLACK).as_secs_f64()
                    )
                }
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe => {
                    "the store closed the connection (its process ended?)".into()
                }
                _ => e.to_string(),
            };
            store_error(&self.addr, op_name, detail)
        };
        let mut stream = self
            .stream
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        stream
            .set_read_timeout(Some(timeout.saturating_add(REPLY_SLACK)))
            .map_err(fail)?;
        stream.write_all(request).map_err(fail)?;
        let status = read_u8(&mut *stream).map_err(fail)?;
        let mut body = Vec::new();
        match (request.first().copied(), status) {
            (_, STATUS_REFUSED) => {
                let why = read_bytes(&mut *stream, MAX_VALUE).map_err(fail)?;
                return Err(store_error(
                    &self.addr,
                    op_name,
                    format!("refused: {}", String::from_utf8_lossy(&why)),
                ));
            }
            (Some(OP_GET), STATUS_OK) | (Some(OP_WAIT), STATUS_TIMEOUT) => {
                body = read_bytes(&mut *stream, MAX_VALUE).map_err(fail)?;
            }
            (Some(OP_ADD), STATUS_OK) => {
                body = read_u64(&mut *stream).map_err(fail)?.to_le_bytes().to_vec();
            }
            (Some(OP_CHECK), STATUS_OK) => {
                let count = request
                    .get(1..5)
                    .map_or(0, |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                body = vec![0u8; (count as usize).min(MAX_KEYS)];
                stream.read_exact(&mut body).map_err(fail)?;
            }
            _ => {}
        }
        Ok((status, body))
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) when the store cannot be reached.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE || key.len() > MAX_KEY {
            return Err(store_error(
                &self.addr,
                &format!("set `{key}`"),
                format!(
                    "keys are limited to {MAX_KEY} bytes and values to {MAX_VALUE}, got {} and {}",
                    key.len(),
                    value.len()
                ),
            ));
        }
        let mut request = vec![OP_SET];
        put_bytes(&mut request, key.as_bytes());
        put_bytes(&mut request, value);
        self.request(&format!("set `{key}`"), &request, Duration::ZERO)
            .map(drop)
    }

    /// The value of `key`, waiting up to `timeout` for some process to set it.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) naming the key when it is not set within `timeout`, or the store
    /// cannot be reached.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let op = format!("get `{key}`");
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // The store parks a request for at most MAX_WAIT: a longer wait asks again.
            let left = deadline.map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()));
            let mut request = vec![OP_GET];
            put_bytes(&mut request, key.as_bytes());
            request.extend_from_slice(&millis(left.min(MAX_WAIT)).to_le_bytes());
            match self.request(&op, &request, left.min(MAX_WAIT))? {
                (STATUS_OK, value) => return Ok(value),
                _ if left > MAX_WAIT => {}
                _ => {
                    return Err(store_error(
                        &self.addr,
                        &op,
                        format!("not set within {} s", timeout.as_secs_f64()),
                    ));
                }
            }
        }
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) when the store cannot be reached.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut request = vec![OP_ADD];
        put_bytes(&mut request, key.as_bytes());
        request.extend_from_slice(&(delta as u64).to_le_bytes());
        let (_, body) = self.request(&format!("add `{key}`"), &request, Duration::ZERO)?;
        let word: [u8; 8] = body
            .get(..8)
            .and_then(|w| w.try_into().ok())
            .ok_or_else(|| {
                store_error(&self.addr, &format!("add `{key}`"), "a short reply".into())
            })?;
        Ok(u64::from_le_bytes(word) as i64)
    }

    /// Which of `keys` exist now (same order).
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) when the store cannot be reached.
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>> {
        let mut request = vec![OP_CHECK];
        put_keys(&mut request, keys);
        let (_, body) = self.request("check", &request, Duration::ZERO)?;
        Ok(body.into_iter().map(|b| b != 0).collect())
    }

    /// Waits until every key of `keys` exists.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) naming the keys still missing when `timeout` passes.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        let outcome = loop {
            // The store parks a request for at most MAX_WAIT: a longer wait asks again.
            let left = deadline.map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()));
            let mut request = vec![OP_WAIT];
            put_keys(&mut request, keys);
            request.extend_from_slice(&millis(left.min(MAX_WAIT)).to_le_bytes());
            match self.request("wait", &request, left.min(MAX_WAIT))? {
                (STATUS_TIMEOUT, _) if left > MAX_WAIT => {}
                outcome => break outcome,
            }
        };
        match outcome {
            (STATUS_OK, _) => Ok(()),
            (_, missing) => Err(store_error(
                &self.addr,
                "wait",
                format!(
                    "keys still missing after {} s: {}",
                    timeout.as_secs_f64(),
                    String::from_utf8_lossy(&missing).replace('\n', ", ")
                ),
            )),
        }
    }
}
