//! `ReadRing`: direct reads kept in flight at once on a real io_uring, against a real file.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;

use uffd_pager::ReadRing;

const PAGE: usize = 4096;

/// The byte at `offset` of the test file: every 4-byte word holds its own offset.
fn expected(offset: usize) -> u8 {
    ((offset / 4) as u32).to_le_bytes()[offset % 4]
}

/// A file of `len` bytes of that pattern, opened again with O_DIRECT, on the disk the target
/// directory lives on (tmpfs may refuse O_DIRECT).
fn file(len: usize) -> (tempfile::TempDir, File) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("data");
    let bytes: Vec<u8> = (0..len).map(expected).collect();
    let mut f = File::create(&path).unwrap();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    (dir, f)
}

#[test]
fn many_reads_in_flight_give_each_its_own_bytes_and_wait_for_room() {
    let (_dir, f) = file(16 << 20);
    // 2 MiB of buffer: eight 256 KiB reads fit at once, so 40 of them must wait for room.
    let mut ring = ReadRing::new(32, 2 << 20).unwrap();
    assert_eq!(ring.buffer_bytes(), 2 << 20);
    let reads: Vec<(u64, usize)> = (0..40u64)
        .map(|i| ((i * 7 % 64) * (256 << 10), 256 << 10))
        .collect();
    let mut next = 0;
    let mut started = HashMap::new();
    let mut most = 0;
    let mut refused = 0;
    let mut checked = 0;
    while checked < reads.len() {
        while next < reads.len() {
            let (offset, len) = reads[next];
            if !ring.start(next as u64, f.as_fd(), offset, len).unwrap() {
                refused += 1;
                break;
            }
            started.insert(next as u64, reads[next]);
            next += 1;
        }
        most = most.max(ring.in_flight());
        let read = ring.wait().unwrap().expect("a read in flight");
        let (offset, len) = started.remove(&read.tag).expect("a tag we started");
        assert_eq!(*read.result.as_ref().unwrap(), len, "read {}", read.tag);
        let bytes = ring.bytes(&read);
        assert_eq!(bytes.len(), len);
        for (k, &b) in bytes.iter().enumerate().step_by(509) {
            assert_eq!(
                b,
                expected(offset as usize + k),
                "read {} byte {k}",
                read.tag
            );
        }
        ring.release(read);
        checked += 1;
    }
    assert_eq!(most, 8, "the buffer holds eight reads at once");
    assert!(refused > 0, "the buffer never ran out of room");
    assert_eq!(ring.in_flight(), 0);
    assert!(ring.wait().unwrap().is_none(), "nothing left to wait for");
}

#[test]
fn reads_of_mixed_sizes_reuse_the_buffer_and_a_read_past_the_end_is_short() {
    let (_dir, f) = file(1 << 20);
    let mut ring = ReadRing::new(8, 1 << 20).unwrap();
    // Rounded up to a whole huge page.
    assert_eq!(ring.buffer_bytes(), 2 << 20);
    for round in 0..50u64 {
        let len = PAGE * (1 + (round as usize * 5) % 40);
        let offset = (round * 3 % 100) * PAGE as u64;
        assert!(ring.start(round, f.as_fd(), offset, len).unwrap());
        let read = ring.wait().unwrap().unwrap();
        assert_eq!(read.tag, round);
        let got = *read.result.as_ref().unwrap();
        assert_eq!(got, len.min((1 << 20) - offset as usize));
        let bytes = &ring.bytes(&read)[..got];
        assert!(
            bytes
                .iter()
                .enumerate()
                .all(|(k, &b)| b == expected(offset as usize + k))
        );
        ring.release(read);
    }
    // Past the end of the file: the read ends with 0 bytes.
    assert!(ring.start(99, f.as_fd(), 2 << 20, PAGE).unwrap());
    let read = ring.wait().unwrap().unwrap();
    assert_eq!(*read.result.as_ref().unwrap(), 0);
    ring.release(read);
}

#[test]
fn a_read_the_ring_cannot_do_is_refused_with_a_reason() {
    let (_dir, f) = file(1 << 20);
    let mut ring = ReadRing::new(4, 2 << 20).unwrap();
    // Not whole pages, not at a page, larger than the buffer, empty.
    for (offset, len) in [(0, 100), (100, PAGE), (0, 4 << 20), (0, 0)] {
        assert!(
            ring.start(0, f.as_fd(), offset, len).is_err(),
            "{offset} {len}"
        );
    }
    // A failing read (a file opened for writing only) ends with its error.
    let w = OpenOptions::new()
        .write(true)
        .open(_dir.path().join("data"))
        .unwrap();
    assert!(ring.start(7, w.as_fd(), 0, PAGE).unwrap());
    let read = ring.wait().unwrap().unwrap();
    assert_eq!(read.tag, 7);
    assert_eq!(
        read.result.as_ref().unwrap_err().raw_os_error(),
        Some(libc::EBADF)
    );
    ring.release(read);
}

#[test]
fn dropping_a_ring_with_reads_in_flight_waits_for_them() {
    let (_dir, f) = file(8 << 20);
    for _ in 0..20 {
        let mut ring = ReadRing::new(16, 4 << 20).unwrap();
        for i in 0..16u64 {
            assert!(
                ring.start(i, f.as_fd(), i * (256 << 10), 256 << 10)
                    .unwrap()
            );
        }
        assert_eq!(ring.in_flight(), 16);
        drop(ring);
    }
}

#[test]
#[should_panic(expected = "a read this ring did not hand out")]
fn a_read_from_another_ring_is_refused() {
    let (_dir, f) = file(1 << 20);
    let mut a = ReadRing::new(4, 2 << 20).unwrap();
    let mut b = ReadRing::new(4, 2 << 20).unwrap();
    assert!(a.start(1, f.as_fd(), 0, PAGE).unwrap());
    assert!(b.start(2, f.as_fd(), 0, 2 * PAGE).unwrap());
    let from_a = a.wait().unwrap().unwrap();
    let _ = b.wait().unwrap().unwrap();
    // The same part of the other ring, ended too, but not this read.
    let _ = b.bytes(&from_a);
}
