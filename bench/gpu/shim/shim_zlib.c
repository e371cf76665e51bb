/* bench/gpu/shim/shim_zlib.c: gzopen, gzread, gzerror and gzclose over plain stdio, for builds without
   zlib's headers (see zlib/zlib.h beside it). Uncompressed files only; gzip data (1f 8b) is refused at the
   first read with Z_DATA_ERROR and a message saying so. Build:
       cc -std=c11 -O2 -c bench/gpu/shim/shim_zlib.c -I bench/gpu/shim/zlib */
#include "zlib.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gzFile_s {
    FILE *f;
    int err, checked;
    char msg[160];
};

gzFile gzopen(const char *path, const char *mode) {
    gzFile g;
    FILE *f = fopen(path, mode && strchr(mode, 'w') ? "wb" : "rb");
    if (!f) return NULL; /* errno says why, as zlib's does */
    g = (gzFile)calloc(1, sizeof *g);
    if (!g) {
        fclose(f);
        errno = 0;
        return NULL;
    }
    g->f = f;
    return g;
}

int gzread(gzFile g, void *buf, unsigned len) {
    size_t got;
    if (!g || g->err) return -1;
    if (!g->checked) {
        unsigned char head[2];
        size_t n = fread(head, 1, 2, g->f);
        g->checked = 1;
        if (n == 2 && head[0] == 0x1f && head[1] == 0x8b) {
            g->err = Z_DATA_ERROR;
            snprintf(g->msg, sizeof g->msg, "gzip-compressed data: this build's zlib stand-in (bench/gpu/shim) reads uncompressed files only");
            return -1;
        }
        if (fseek(g->f, 0, SEEK_SET) != 0) {
            g->err = Z_ERRNO;
            return -1;
        }
    }
    got = fread(buf, 1, len, g->f);
    if (got < len && ferror(g->f)) {
        g->err = Z_ERRNO;
        return -1;
    }
    return (int)got;
}

const char *gzerror(gzFile g, int *errnum) {
    if (errnum) *errnum = g ? g->err : Z_OK;
    if (!g || !g->err) return "";
    return g->err == Z_ERRNO ? strerror(errno) : g->msg;
}

int gzclose(gzFile g) {
    int rc;
    if (!g) return -2;
    rc = fclose(g->f) == 0 ? Z_OK : Z_ERRNO;
    free(g);
    return rc;
}
