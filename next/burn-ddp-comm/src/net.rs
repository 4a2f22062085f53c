//! Waiting on a listening socket without a sleep: an accept loop wakes as soon as a connection
//! arrives (a sleep between tries cost every connection of the rendezvous up to its length), and
//! still looks at its stop flag every `timeout`.

use std::net::TcpListener;
use std::time::Duration;

/// Waits until `listener` has a connection to accept, or `timeout` passes.
#[cfg(unix)]
pub(crate) fn wait_for_connection(listener: &TcpListener, timeout: Duration) {
    use std::os::unix::io::AsRawFd;
    let mut fd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fd` is one valid pollfd structure for the call's duration.
    unsafe {
        libc::poll(&mut fd, 1, millis);
    }
}

/// Waits `timeout` at most (no `poll` here: a short sleep).
#[cfg(not(unix))]
pub(crate) fn wait_for_connection(_listener: &TcpListener, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_millis(10)));
}
