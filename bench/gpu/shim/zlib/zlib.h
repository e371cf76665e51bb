/* bench/gpu/shim/zlib/zlib.h: the part of zlib that examples/mlp.h's IDX loader uses (gzopen, gzread,
   gzerror, gzclose), for a machine without zlib's headers (bench/gpu/run.sh puts this directory first on
   the include path then, and links shim_zlib.c). It reads UNCOMPRESSED files only, as zlib's gzopen reads
   a file that is not gzip data: run.sh gives the trainers uncompressed IDX files under the .gz names the
   loader asks for (bench/gpu/runtool.py data). A gzip file is refused at its first read, with a message. */
#ifndef AVGPIPE_SHIM_ZLIB_H
#define AVGPIPE_SHIM_ZLIB_H

#ifdef __cplusplus
extern "C" {
#endif

#define Z_OK 0
#define Z_ERRNO (-1)
#define Z_DATA_ERROR (-3)

typedef struct gzFile_s *gzFile;

gzFile gzopen(const char *path, const char *mode);
int gzread(gzFile file, void *buf, unsigned len);
const char *gzerror(gzFile file, int *errnum);
int gzclose(gzFile file);

#ifdef __cplusplus
}
#endif
#endif
